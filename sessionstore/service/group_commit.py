"""Group commit: the mid-turn commits that the engine thread's decode loops ask for in one pass
(after one batched step), started together at the end of that pass, each in a thread of its own,
and run while the next batched step computes.

Sessions that started together commit together (every ``--commit-every`` tokens, in the same
step); one after another, their fsyncs (each on its own files) would hold the whole batch for
the sum of them, and even overlapped they would hold it for the slowest. Started at the end of
the pass, they overlap each other and the next step. A commit is two parts
(:meth:`sessionstore.sessions.Session.begin_commit`): the part run in the pass hands the new rows
to the writer and fixes what the commit covers; the part put off here only makes those records
durable and touches neither the cache nor the pending token, so the next step may append to the
cache meanwhile. Before a loop is run on again (sent the logits of that next step) or its turn is
woken, the engine thread waits for the loop's commit (:meth:`GroupCommit.wait`): a loop never
hands rows to a writer whose commit is in flight, and a turn never sees its commit unfinished.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any


class GroupCommit:
    """Commits put off while one thread runs loops on (:meth:`collecting`), started together
    (:meth:`start_all`) and awaited one owner at a time (:meth:`wait`)."""

    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)
        self._pool: ThreadPoolExecutor | None = None
        self._collector: int | None = None  # the thread whose loops' commits are put off
        self._owner: Any = None  # the loop being run on: the owner of the commits it puts off
        self._jobs: dict[Any, list[Callable[[], object]]] = {}  # put off in this pass, by owner
        self._running: dict[Any, Future[BaseException | None]] = {}  # started, not waited for yet

    @contextmanager
    def collecting(self, owner: Any) -> Iterator[None]:
        """While this thread runs ``owner``'s loop on, the commits it asks for are put off."""
        self._collector, self._owner = threading.get_ident(), owner
        try:
            yield
        finally:
            self._collector = self._owner = None

    def put_off(self, commit: Callable[[], object]) -> bool:
        """Queue ``commit`` for :meth:`start_all` (True), or False when no loop is being run on
        in this thread (the caller commits now)."""
        if self._collector != threading.get_ident() or self._owner is None:
            return False
        self._jobs.setdefault(self._owner, []).append(commit)
        return True

    def start_all(self) -> None:
        """Start every commit put off in this pass, each owner's in a thread of its own (one
        owner's in the order they were put off); returns at once."""
        jobs, self._jobs = self._jobs, {}
        if not jobs:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="coli-commit")
        for owner, commits in jobs.items():
            assert owner not in self._running  # waited for before its loop could ask again
            self._running[owner] = self._pool.submit(_run, commits)

    def wait(self, owner: Any) -> BaseException | None:
        """Wait for ``owner``'s commits started by :meth:`start_all` (none: at once); the error
        that ended them, or None."""
        running = self._running.pop(owner, None)
        return None if running is None else running.result()

    def in_flight(self) -> int:
        """Owners whose commits were started and not waited for."""
        return len(self._running)

    def close(self) -> None:
        """Wait for every commit started, then stop the threads."""
        for owner in list(self._running):
            self.wait(owner)
        self._jobs.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _run(commits: list[Callable[[], object]]) -> BaseException | None:
    """Run one owner's commits in order; the first error stops them and is returned (handed to
    the owner's turn, which re-raises it)."""
    for commit in commits:
        try:
            commit()
        except BaseException as exc:
            return exc
    return None


__all__ = ["GroupCommit"]
