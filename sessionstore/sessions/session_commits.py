"""A session's commit path (:class:`CommitPath`, held by :class:`~sessionstore.sessions.session.Session`):
the commit split in two (:meth:`~CommitPath.begin` fixes what it covers, its callable writes it: the kv
commit, then the manifest's dynamic fields, :mod:`sessionstore.sessions.committer`), a turn's commits
run through the options' ``commit_runner`` (a durable stream's while the turn runs on; a fleet's
shipping is wrapped around that runner when the session is opened, never swapped in later), the guard
that fences them (a LeaseKeeper) and the fence after a commit failed with an I/O error
(:mod:`sessionstore.sessions.fence`). It reads and writes its session's state through
:class:`Committing`.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, Protocol

import numpy as np

from kernels.errors import ColiError
from sessionstore.kvfile import Durability
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
from sessionstore.sessions.manifest import MANIFEST_NAME, Manifest
from sessionstore.sessions.resident_files import ResidentFiles
from sessionstore.sessions.session_home import SessionHome
from sessionstore.sessions.session_options import SessionOptions

log = get_logger("session")


class Committing(Protocol):
    """The session as its commit path reads and writes it (a :class:`Session` is one)."""

    id: str
    store: SessionHome
    directory: Path
    kv_path: Path
    manifest: Manifest
    state: str
    pending: list[int]
    options: SessionOptions
    commit_watch: CommitWatch | None
    files: ResidentFiles

    def await_files(self) -> None: ...


class CommitPath:
    """The commit path of one session: its :class:`Committer`, the guard and the fence over it, the
    last position's logits it commits, and the durable stream's commit in flight."""

    def __init__(self, session: Committing) -> None:
        self.session = session
        self.committer = Committer(session.id, session.directory / MANIFEST_NAME, session.kv_path,
                                   (session.options.durability or Durability()).fsync)  # the page's barrier: the seam's
        self.fence: Fence | None = None  # set when a commit failed with an I/O error (sessions.fence)
        self.guard: Any = None  # a LeaseKeeper while the object-store tier keeps this host's lease
        self.in_flight = False  # a durable-stream commit handed to the runner has not returned yet
        self.deferred = False  # resumed with the last position's check still to do (recovery.verify_last)

    @property
    def timing(self) -> dict[str, float]:
        """The last commit: kv commit, state wait, state write (seconds)."""
        return self.committer.timing

    def guard_with(self, keeper: Any) -> None:
        """Fence this resident session's commits with ``keeper`` (a LeaseKeeper: its ``check()``
        runs before every commit; ``stop()`` when the session is released)."""
        if self.session.state != "resident":
            raise ColiError(f"session {self.session.id!r} is {self.session.state}: resume it first")
        self.guard = keeper

    def stop_guard(self) -> None:
        """The session is released: its guard stops (resumed through RemoteStore.resume again)."""
        if self.guard is not None:
            self.guard.stop()
            self.guard = None

    def _check(self) -> None:
        """Refuse a commit of a fenced session, or one whose guard lost its lease."""
        if self.fence is not None:
            raise SessionFencedError(self.fence)
        if self.guard is not None:
            self.guard.check()  # LockedError once another host owns the session

    def begin(self, *, catalogue: bool = True) -> Callable[[], int]:
        """The commit's first part, now: the rows not handed to the writer yet are handed over
        and what the commit covers is fixed (the records appended so far, the pending token).
        The returned callable is the rest (the kv commit, then the manifest's dynamic fields;
        returns the count): it reads neither the cache nor ``pending``, so it may run while the
        cache grows (a server runs it beside its next batched step). Nothing may append to the
        writer or commit this session again until it has returned. ``catalogue`` False: the
        store's catalogue row is left to a later commit (a turn's commits inside it leave it to
        the turn's last, FORMAT.md 5.9)."""
        s = self.session
        if s.state != "resident":
            committed = s.manifest.committed
            return lambda: committed
        self._check()
        s.await_files()  # a new session's first commit: its files made meanwhile (start_files)
        s.files.append_rows()  # the rows not handed to the writer yet (decode appends in runs)
        writer = s.files.live_writer
        n = writer.length  # what the commit makes durable (checked against the cache there)
        length, pending = s.files.live_cache.length, list(s.pending)
        noted = self.committer.noted()  # the last position's logits: the next token may note others meanwhile
        watch = s.commit_watch
        mark = watch.mark() if watch is not None else 0  # the text this commit covers (durable stream)
        durable = s.options.manifest_fsync or s.options.durable_stream

        def finish() -> int:
            before = s.manifest
            try:
                s.manifest = self.committer.commit(writer, s.manifest, pending, length, noted=noted, durable=durable)
            except OSError as exc:
                if not fences(exc):
                    raise
                self._fence(exc, writer.nrec)
            if s.manifest is not before and catalogue:  # the catalogue's row follows (FORMAT.md 5.9)
                s.store.note_session(s.manifest, resident=True)
            if watch is not None:  # returned: the text of the tokens it covers may go out
                watch.committed(mark)
            return n

        return finish

    def begin_tail(self) -> BarrierCommit | None:
        """A durable stream's tail commit (:mod:`sessionstore.sessions.durable_text`), split like
        :meth:`begin`: fixed now, its callable writes the state page alone (one ``pwrite``, one
        fdatasync) with ``committed`` and ``last_logits`` those of the last kv commit and
        ``pending`` = every token after its records (the ones fed since, then the ones drawn and
        not fed); split again at its barrier (a :class:`BarrierCommit`), so a server may cover
        several sessions' pages with one. None when it must be a kv commit instead: the tail
        would exceed ``MAX_PENDING`` (the page's payload limit holds that many), or the manifest
        does not describe the writer's committed records."""
        s = self.session
        if s.state != "resident":
            return None
        self._check()
        s.await_files()
        n, base, cache = s.files.live_writer.nrec, s.manifest, s.files.live_cache
        tail = [*cache.tokens_from(n).tolist(), *s.pending]  # (``tokens`` copies every position)
        if len(tail) > MAX_PENDING or base.committed != n:
            return None
        watch = s.commit_watch
        mark = watch.mark() if watch is not None else 0  # the text this commit covers
        written: list[Manifest] = []

        def write() -> int:
            written.append(self.committer.write_tail(base, tail))
            return self.committer.page.fd

        def settle(error: BaseException | None) -> int:
            if error is not None:
                if isinstance(error, OSError) and fences(error):  # reopened with the last tail that returned
                    self._fence(error, n, pending=base.pending)
                raise error
            s.manifest = written[0]
            if watch is not None:
                watch.committed(mark)
            return n

        return BarrierCommit(write, self.committer.barrier, settle, self.committer.share_key())

    def _fence(self, exc: OSError, verified: int, *, pending: list[int] | None = None) -> NoReturn:
        """A commit failed with an I/O error: nothing more is written for this session; it is
        reopened from its ``verified`` records only (:mod:`sessionstore.sessions.fence`)."""
        s = self.session
        self.fence = fence_of(s.id, verified, exc, pending)
        log.error("session.fenced", id=s.id, verified=verified, error=self.fence.error, message=str(exc))
        record_fence(s.directory, self.fence)  # a later process cuts it back the same way first
        raise SessionFencedError(self.fence) from exc

    def run(self, *, catalogue: bool = True, tail: bool = False) -> None:
        """A turn's commit: its first part here, the rest by the options' ``commit_runner`` when
        there is one (a server's engine runs it beside its next batched step, or lets the turn run
        it without holding the other sessions back), else here. ``tail``: a tail commit when it
        can be one (:meth:`begin_tail`), else a kv commit."""
        finish: Callable[[], int] | None = self.begin_tail() if tail else None
        if finish is None:
            finish = self.begin(catalogue=catalogue)
        runner = self.session.options.commit_runner
        if runner is None:
            finish()
        elif not self.session.options.durable_stream:
            runner(finish)
        else:  # the loop runs on while it is in flight (no rows handed over, no commit begun meanwhile)
            def clear() -> None:
                self.in_flight = False

            def finish_then_clear() -> int:
                try:
                    return finish()
                finally:
                    clear()

            self.in_flight = True  # a tail commit stays a BarrierCommit: one barrier may cover several
            split = finish.then(clear) if isinstance(finish, BarrierCommit) else finish_then_clear
            runner(split, overlap=True)

    def note_logits(self, logits: np.ndarray | None) -> None:
        """The logits of the last appended position, digested now (hot in cache); None forgets them."""
        if logits is not None:
            self.deferred = False  # a later position: the deferred check has nothing left to check
        self.committer.note_logits(logits, 0 if logits is None else self.session.files.live_cache.length)


__all__ = ["CommitPath", "Committing"]
