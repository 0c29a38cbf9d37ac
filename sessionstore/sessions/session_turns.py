"""A session's turns (:class:`SessionTurns`, a base of :class:`~sessionstore.sessions.session.Session`):
:meth:`~SessionTurns.generate` (prefix reuse, feeding, the decode loop of
:mod:`sessionstore.sessions.turn_loop`, commits every ``commit_every`` tokens), prompt ingestion
without sampling (:meth:`~SessionTurns.append_tokens`) and :meth:`~SessionTurns.truncate`.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from kernels.errors import FormatError
from kernels.model.logits import TurnDraw, settings_of
from kernels.model.sampling import Sampler
from sessionstore.log import get_logger
from sessionstore.sessions.manifest import MANIFEST_NAME, write_manifest
from sessionstore.sessions.session_resume import SessionResume
from sessionstore.sessions.turn_loop import (
    DecodeDriver,
    TurnResult,
    common_prefix,
    feed_chunk,
    run_turn,
)

APPEND_RUN = 8  # decoded records are handed to the writer 8 at a time (and at every commit): one
# hand-over per token cost ~0.7 ms of per-token work that a batched decode step cannot share
IO_ROWS = 64  # a hand-over of at least this many rows (a prompt's) runs by the session's io_runner

log = get_logger("session")


class SessionTurns(SessionResume):
    """Turns over a resident session; resume and the commit path below them.

    Why 22 methods: 17 are its bases' (the commit path, resume and release, and a new session's
    files made behind its first turn: :meth:`SessionResume.start_files` / ``await_files``); its own
    5 are the turns (generate, append_tokens, truncate) and the rows' hand-over they share."""

    # what a turn reads of its session, beside resume's and the commit path's (set by Session.__init__)
    commit_every: int | None
    decode_driver: DecodeDriver | None

    def generate(self, prompt_ids: Sequence[int] | None = None, max_new: int = 16, *,
                 stop_at_eos: bool = False, sampler: Sampler | TurnDraw | None = None, keep_sampler: bool = True,
                 on_token: Callable[[int, int], None] | None = None) -> TurnResult:
        """One turn. With ``prompt_ids`` the longest common prefix of the history is reused (the
        rest truncated) and the remainder fed; without, generation continues where it stopped.
        ``sampler``: this turn's settings (None: the manifest's), or a :class:`TurnDraw` over them;
        with ``keep_sampler`` the settings are stored in the manifest for the turns after it,
        without they serve this turn only."""
        t0 = time.perf_counter()
        self.ensure_resident()
        self.residency.touch(self)
        if sampler is not None and keep_sampler and settings_of(sampler) != self.manifest.sampler:
            self.await_files()  # the manifest on disk is rewritten: a new session's must be there
            changed = dataclasses.replace(self.manifest, sampler=settings_of(sampler))
            write_manifest(self.directory / MANIFEST_NAME, changed)  # durable: rare; a failed one changes nothing
            self.manifest = changed
        turn_sampler = self.manifest.sampler if sampler is None else sampler
        result = TurnResult()
        feed: list[int] | None
        if prompt_ids is not None:
            prompt = self.model.check_tokens(np.asarray(prompt_ids, dtype=np.int64))  # [m] i32, no Python list
            if not prompt.size:
                raise FormatError("the prompt is empty")
            k = common_prefix(self._files.live_cache.tokens, prompt)
            if k < self._files.live_cache.length:
                self.truncate(k)
            result.reused_prefix = k
            feed = [int(t) for t in prompt[k:]]
        else:
            feed = list(self.pending) if self.pending else None
            if feed is None and self._committer.logits is None and self._files.live_cache.length:
                self._note_logits(self._last_logits())
        result.fed = len(feed) if feed else 0
        commits_before = self._committer.commits

        def on_step(token: int, position: int, logits: np.ndarray) -> None:
            self.pending = [token]
            self._note_logits(logits)
            if on_token is not None:
                on_token(token, position)
            every = self.commit_every
            due = bool(every) and self._files.live_cache.length - self._files.nrec >= (every or 0)
            if self.durable_stream:  # every token (its text is held until then), unless one is in flight:
                if not self._in_flight:  # the next one covers this token too; a kv commit when due,
                    self._commit_through_runner(tail=not due)  # else a tail commit (the page alone)
            elif due and self._files.ready():  # a new session's files still being made: the commit
                self._commit_through_runner()  # waits a token (a server's loop must not wait for them)

        tokens, logits, eos = run_turn(self.model, self._files.live_cache, feed, self._committer.logits, max_new,
                                       turn_sampler, stop_at_eos=stop_at_eos,
                                       on_rows=self._append_in_runs, on_step=on_step, drive=self.decode_driver)
        if not tokens:
            self.pending = []
        self._note_logits(logits)
        assert not self._in_flight  # a turn is woken only once its commits returned
        self._commit_through_runner()
        result.tokens, result.stopped_at_eos = tokens, eos
        result.committed = self._files.live_writer.nrec
        result.commits = self._committer.commits - commits_before
        result.seconds = time.perf_counter() - t0
        self.residency.touch(self)
        return result

    def _append_in_runs(self) -> None:
        """After a forward: hand the new rows to the writer once APPEND_RUN of them wait (a prefill
        at once; decode steps in runs, and every commit hands over the rest first). Rows not yet
        handed over are only uncommitted ones, which a crash loses either way."""
        if self._in_flight or not self._files.ready():  # a commit is writing from the writer, or a new
            return  # session's files are being made: the rows wait for the next hand-over (or commit)
        if self._files.live_cache.length - self._files.live_writer.length >= APPEND_RUN:
            self._hand_over_rows()

    def _hand_over_rows(self) -> None:
        """The cache's rows past the writer's length, handed to it: a prompt's many rows (at least
        ``IO_ROWS``: their packing, writes and checksums) by :meth:`run_io`, on a server's I/O thread
        while its loop steps the other sessions (nothing else touches this session's cache or writer
        meanwhile); a decode run's few here. None while a new session's files are being made."""
        if not self._files.ready():
            return
        if self._files.live_cache.length - self._files.live_writer.length >= IO_ROWS:
            self.run_io(self._files.append_rows)
        else:
            self._files.append_rows()

    def append_tokens(self, tokens: Sequence[int], *, commit: bool | None = None) -> np.ndarray:
        """Feed ``tokens`` as records without sampling (prompt ingestion); returns the last logits.

        The pending token is dropped (these tokens replace it). ``commit``: True commits now,
        False never, None follows the commit policy.
        """
        self.ensure_resident()
        toks = [int(t) for t in self.model.check_tokens(np.asarray(list(tokens), dtype=np.int64))]
        logits = feed_chunk(self.model, self._files.live_cache, toks, self._hand_over_rows)
        self.pending = []
        self._note_logits(logits)
        self.await_files()
        writer = self._files.live_writer
        due = bool(self.commit_every) and writer.length - writer.nrec >= (self.commit_every or 0)
        if commit or (commit is None and due):
            self.run_io(self.begin_commit())  # the kv commit's writes and fsyncs by run_io (:meth:`commit`)
        return logits

    def truncate(self, n: int) -> int:
        """Keep the first ``n`` records (prefix reuse). The manifest's epoch is bumped FIRST."""
        self.ensure_resident()
        n = max(0, min(int(n), self._files.live_cache.length))
        self.commit()  # the manifest must never claim records the file has not committed
        cut = dataclasses.replace(self.manifest, epoch=self.manifest.epoch + 1, committed=n, pending=[],
                                  last_logits=None)
        # a write that fails (ENOSPC: no room for the temp file) changes nothing, here or on disk
        write_manifest(self.directory / MANIFEST_NAME, cut, durable=self.manifest_fsync)
        self.manifest, self.pending = cut, []
        self._note_logits(None)
        self._deferred = False  # the position changes: no digest describes the new last one
        self._files.live_writer.truncate(n)
        self._files.live_cache.truncate(n)
        self.store.note_session(self.manifest, resident=True)
        log.info("session.truncate", id=self.id, committed=n, epoch=self.manifest.epoch)
        return n


__all__ = ["APPEND_RUN", "IO_ROWS", "SessionTurns"]
