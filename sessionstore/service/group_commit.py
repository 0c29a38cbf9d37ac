"""Group commit: the mid-turn commits that the engine thread's decode loops ask for in one pass
(after one batched step), run together at the end of that pass, each in a thread of its own.

Sessions that started together commit together (every ``--commit-every`` tokens, in the same
step); one after another, their fsyncs (each on its own files) would hold the whole batch for
the sum of them. Run at once, they overlap. A commit put off this way still runs before its
session's next step: the token the loop yielded is not fed yet, so the commit makes exactly the
records it would have made at once.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any


class GroupCommit:
    """Commits put off while one thread runs loops on (:meth:`collecting`), then run together."""

    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)
        self._pool: ThreadPoolExecutor | None = None
        self._collector: int | None = None  # the thread whose loops' commits are put off
        self._owner: Any = None  # the loop being run on: the owner of the commits it puts off
        self._jobs: list[tuple[Any, Callable[[], object]]] = []

    @contextmanager
    def collecting(self, owner: Any) -> Iterator[None]:
        """While this thread runs ``owner``'s loop on, the commits it asks for are put off."""
        self._collector, self._owner = threading.get_ident(), owner
        try:
            yield
        finally:
            self._collector = self._owner = None

    def put_off(self, commit: Callable[[], object]) -> bool:
        """Queue ``commit`` for :meth:`run_all` (True), or False when no loop is being run on
        in this thread (the caller commits now)."""
        if self._collector != threading.get_ident() or self._owner is None:
            return False
        self._jobs.append((self._owner, commit))
        return True

    def run_all(self) -> list[tuple[Any, BaseException]]:
        """Run every commit put off, at once; waits for all. Returns (owner, error) of each failure."""
        jobs, self._jobs = self._jobs, []
        if len(jobs) == 1:  # nothing to overlap with: no hand-over to a thread
            return [failure for failure in [_run(*jobs[0])] if failure is not None]
        if not jobs:
            return []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="coli-commit")
        return [failure for failure in self._pool.map(lambda job: _run(*job), jobs) if failure is not None]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _run(owner: Any, commit: Callable[[], object]) -> tuple[Any, BaseException] | None:
    try:
        commit()
    except BaseException as exc:  # handed to the owner's turn, which re-raises it
        return owner, exc
    return None


__all__ = ["GroupCommit"]
