"""A session's commits (:class:`SessionCommits`, a base of :class:`~sessionstore.sessions.session.Session`):
the commit split in two (:meth:`~SessionCommits.begin_commit` fixes what it covers, its callable writes
it: the kv commit, then the manifest's dynamic fields, :mod:`sessionstore.sessions.committer`), a
turn's commits run through the server's ``commit_runner`` (a durable stream's while the turn runs on),
and the fence after a commit failed with an I/O error (:mod:`sessionstore.sessions.fence`).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from sessionstore.log import get_logger
from sessionstore.sessions.committer import BarrierCommit, Committer
from sessionstore.sessions.durable_text import CommitWatch
from sessionstore.sessions.fence import (
    Fence,
    SessionFencedError,
    fence_of,
    fences,
    record_fence,
)
from sessionstore.sessions.fields import MAX_PENDING
from sessionstore.sessions.manifest import Manifest
from sessionstore.sessions.resident_files import ResidentFiles
from sessionstore.sessions.session_home import CommitRunner, SessionHome

log = get_logger("session")


class SessionCommits:
    """The commit path of a resident session; the session's state is :class:`Session`'s."""

    # what the commit path reads and writes of its session (set by Session.__init__)
    id: str
    store: SessionHome
    directory: Path
    manifest: Manifest
    manifest_fsync: bool
    state: str
    pending: list[int]
    fence: Fence | None
    durable_stream: bool
    commit_runner: CommitRunner | None
    commit_watch: CommitWatch | None
    _files: ResidentFiles
    _committer: Committer
    _guard: Any
    _in_flight: bool
    _deferred: bool
    await_files: Callable[[], None]  # a new session's files made, its writer held (SessionResume's)

    def commit(self) -> int:
        """kv commit (the commit point), then the manifest's dynamic fields; returns the count
        (:class:`sessionstore.sessions.committer.Committer`)."""
        return self.begin_commit()()

    def begin_commit(self, *, catalogue: bool = True) -> Callable[[], int]:
        """The commit's first part, now: the rows not handed to the writer yet are handed over
        and what the commit covers is fixed (the records appended so far, the pending token).
        The returned callable is the rest (the kv commit, then the manifest's dynamic fields;
        returns the count): it reads neither the cache nor ``pending``, so it may run while the
        cache grows (a server runs it beside its next batched step). Nothing may append to the
        writer or commit this session again until it has returned. ``catalogue`` False: the
        store's catalogue row is left to a later commit (a durable stream's per-token ones)."""
        if self.state != "resident":
            committed = self.manifest.committed
            return lambda: committed
        if self.fence is not None:
            raise SessionFencedError(self.fence)
        if self._guard is not None:
            self._guard.check()  # LockedError once another host owns the session
        self.await_files()  # a new session's first commit: its files made meanwhile (start_files)
        self._files.append_rows()  # the rows not handed to the writer yet (decode appends in runs)
        writer = self._files.live_writer
        n = writer.length  # what the commit makes durable (checked against the cache there)
        length, pending = self._files.live_cache.length, list(self.pending)
        noted = self._committer.noted()  # the last position's logits: the next token may note others meanwhile
        watch = self.commit_watch
        mark = watch.mark() if watch is not None else 0  # the text this commit covers (durable stream)

        def finish() -> int:
            before = self.manifest
            try:
                self.manifest = self._committer.commit(writer, self.manifest, pending, length, noted=noted,
                                                       durable=self.manifest_fsync or self.durable_stream)
            except OSError as exc:
                if not fences(exc):
                    raise
                self._fence(exc, writer.nrec)
            if self.manifest is not before and catalogue:  # the catalogue's row follows (FORMAT.md 5.9)
                self.store.note_session(self.manifest, resident=True)
            if watch is not None:  # returned: the text of the tokens it covers may go out
                watch.committed(mark)
            return n

        return finish

    def begin_tail_commit(self) -> BarrierCommit | None:
        """A durable stream's tail commit (:mod:`sessionstore.sessions.durable_text`), split like
        :meth:`begin_commit`: fixed now, its callable writes the state page alone (one
        ``pwrite``, one fdatasync) with ``committed`` and ``last_logits`` those of the last kv
        commit and ``pending`` = every token after its records (the ones fed since, then the
        ones drawn and not fed); split again at its barrier (a :class:`BarrierCommit`), so a
        server may cover several sessions' pages with one. None when it must be a kv commit
        instead: the tail would exceed ``MAX_PENDING`` (the page's payload limit holds that
        many), or the manifest does not describe the writer's committed records."""
        if self.state != "resident":
            return None
        if self.fence is not None:
            raise SessionFencedError(self.fence)
        if self._guard is not None:
            self._guard.check()  # LockedError once another host owns the session
        self.await_files()
        n, base, cache = self._files.live_writer.nrec, self.manifest, self._files.live_cache
        tail = [*cache.tokens_from(n).tolist(), *self.pending]  # (``tokens`` copies every position)
        if len(tail) > MAX_PENDING or base.committed != n:
            return None
        watch = self.commit_watch
        mark = watch.mark() if watch is not None else 0  # the text this commit covers
        written: list[Manifest] = []

        def write() -> int:
            written.append(self._committer.write_tail(base, tail))
            return self._committer.page.fd

        def settle(error: BaseException | None) -> int:
            if error is not None:
                if isinstance(error, OSError) and fences(error):  # reopened with the last tail that returned
                    self._fence(error, n, pending=base.pending)
                raise error
            self.manifest = written[0]
            if watch is not None:
                watch.committed(mark)
            return n

        return BarrierCommit(write, self._committer.barrier, settle, self._committer.share_key())

    def _fence(self, exc: OSError, verified: int, *, pending: list[int] | None = None) -> NoReturn:
        """A commit failed with an I/O error: nothing more is written for this session; it is
        reopened from its ``verified`` records only (:mod:`sessionstore.sessions.fence`)."""
        self.fence = fence_of(self.id, verified, exc, pending)
        log.error("session.fenced", id=self.id, verified=verified, error=self.fence.error, message=str(exc))
        record_fence(self.directory, self.fence)  # a later process cuts it back the same way first
        raise SessionFencedError(self.fence) from exc

    def _commit_through_runner(self, *, catalogue: bool = True, tail: bool = False) -> None:
        """A turn's commit: its first part here, the rest by ``commit_runner`` when there is one
        (a server's engine runs it beside its next batched step, or lets the turn run it without
        holding the other sessions back), else here. ``tail``: a tail commit when it can be one
        (:meth:`begin_tail_commit`), else a kv commit."""
        finish: Callable[[], int] | None = self.begin_tail_commit() if tail else None
        if finish is None:
            finish = self.begin_commit(catalogue=catalogue)
        if self.commit_runner is None:
            finish()
        elif not self.durable_stream:
            self.commit_runner(finish)
        else:  # the loop runs on while it is in flight (no rows handed over, no commit begun meanwhile)
            def clear() -> None:
                self._in_flight = False

            def finish_then_clear() -> int:
                try:
                    return finish()
                finally:
                    clear()

            self._in_flight = True  # a tail commit stays a BarrierCommit: one barrier may cover several
            split = finish.then(clear) if isinstance(finish, BarrierCommit) else finish_then_clear
            self.commit_runner(split, overlap=True)

    def _note_logits(self, logits: np.ndarray | None) -> None:
        """The logits of the last appended position, digested now (hot in cache)."""
        if logits is not None:
            self._deferred = False  # a later position: the deferred check has nothing left to check
        self._committer.note_logits(logits, 0 if logits is None else self._files.live_cache.length)


__all__ = ["SessionCommits"]
