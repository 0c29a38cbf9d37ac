"""Group commit: the mid-turn commits that the engine thread's decode loops ask for in one pass
(after one batched step), started together at the end of that pass, each in a thread of its own,
and run while the next batched step computes.

Sessions that started together commit together (every ``--commit-every`` tokens, in the same
step); one after another, their fsyncs (each on its own files) would hold the whole batch for
the sum of them, and even overlapped they would hold it for the slowest. Started at the end of
the pass, they overlap each other and the next step. A commit is two parts
(:meth:`sessionstore.sessions.CommitPath.begin`): the part run in the pass hands the new rows
to the writer and fixes what the commit covers; the part put off here only makes those records
durable and touches neither the cache nor the pending token, so the next step may append to the
cache meanwhile. Before a loop is run on again (sent the logits of that next step) or its turn is
woken, the engine thread waits for the loop's commit (:meth:`GroupCommit.wait`): a loop never
hands rows to a writer whose commit is in flight, and a turn never sees its commit unfinished.

A commit put off with ``overlap`` (a durable-stream session's per-token commit,
:mod:`sessionstore.sessions.durable_text`) is not waited for before its loop runs on
(:meth:`GroupCommit.ready`): its session guards its own writer (no rows handed over, no commit
begun, while one is in flight; the next commit covers the tokens drawn meanwhile), so a commit
slower than a step delays only the text it releases, never the steps. Its turn still waits for
it before it is woken (:meth:`GroupCommit.wait`).

The tail commits of one pass (:class:`sessionstore.sessions.BarrierCommit`, each a state page and
its fdatasync) whose pages lie on one file system run as ONE task under ONE barrier
(:func:`sessionstore.sessions.commit_together`: every page written, one ``syncfs``, each settled):
one barrier and one thread hand-off per step instead of one per session (``share=False``: one
each, as a kv commit always is).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sessionstore.sessions import BarrierCommit, commit_together


class _Collecting:
    """:meth:`GroupCommit.collecting`'s context: ``owner``'s commits put off inside it."""

    __slots__ = ("commits", "owner")

    def __init__(self, commits: GroupCommit, owner: Any) -> None:
        self.commits, self.owner = commits, owner

    def __enter__(self) -> None:
        self.commits._collector, self.commits._owner = threading.get_ident(), self.owner

    def __exit__(self, *exc: object) -> None:
        self.commits._collector = self.commits._owner = None


class GroupCommit:
    """Commits put off while one thread runs loops on (:meth:`collecting`), started together
    (:meth:`start_all`) and awaited one owner at a time (:meth:`ready`, :meth:`wait`)."""

    def __init__(self, workers: int, *, share: bool = True) -> None:
        self.workers = max(1, workers)
        self.share = share  # tail commits of one pass on one file system: one barrier for them all
        self._pool: ThreadPoolExecutor | None = None
        self._collector: int | None = None  # the thread whose loops' commits are put off
        self._owner: Any = None  # the loop being run on: the owner of the commits it puts off
        self._jobs: dict[Any, _Job] = {}  # put off in this pass, by owner
        self._running: dict[Any, list[_Started]] = {}  # started, not waited for yet (oldest first)

    def collecting(self, owner: Any) -> _Collecting:
        """``with`` it: while this thread runs ``owner``'s loop on, the commits it asks for are put
        off (a plain object, not a generator: the loop enters one per running turn per step)."""
        return _Collecting(self, owner)

    def put_off(self, commit: Callable[[], object], *, overlap: bool = False) -> bool:
        """Queue ``commit`` for :meth:`start_all` (True), or False when no loop is being run on
        in this thread (the caller commits now). ``overlap``: its loop may run on before it ends."""
        if self._collector != threading.get_ident() or self._owner is None:
            return False
        job = self._jobs.setdefault(self._owner, _Job([], overlap))
        job.commits.append(commit)
        job.overlap = job.overlap and overlap
        return True

    def start_all(self) -> None:
        """Start every commit put off in this pass, each owner's in a thread of its own (one
        owner's in the order they were put off); returns at once."""
        jobs, self._jobs = self._jobs, {}
        if not jobs:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="coli-commit")
        groups: dict[Hashable, list[tuple[Any, BarrierCommit]]] = {}
        for owner, job in jobs.items():
            assert all(s.overlap for s in self._running.get(owner, []))  # else waited for before it asked again
            one = job.commits[0] if len(job.commits) == 1 else None
            if self.share and job.overlap and isinstance(one, BarrierCommit) and one.share is not None:
                groups.setdefault(one.share, []).append((owner, one))
                continue
            self._running.setdefault(owner, []).append(_Started(self._pool.submit(_run, job.commits), job.overlap))
        for members in groups.values():  # one task, one barrier for the pages of every member
            if len(members) == 1:
                owner, commit = members[0]
                self._running.setdefault(owner, []).append(_Started(self._pool.submit(_run, [commit]), True))
                continue
            group = self._pool.submit(_run_together, [c for _, c in members])  # one future for them all
            for index, (owner, _) in enumerate(members):
                self._running.setdefault(owner, []).append(_Started(group, True, index))

    def ready(self, owner: Any) -> BaseException | None:
        """Before ``owner``'s loop runs on: its commits that ended are collected and the others
        waited for, except those started with ``overlap`` (left running); the first error of
        those collected, or None."""
        running = self._running.pop(owner, [])
        left = [s for s in running if s.overlap and not s.future.done()]
        if left:
            self._running[owner] = left
        errors = [s.result() for s in running if s not in left]
        return next((e for e in errors if e is not None), None)

    def wait(self, owner: Any) -> BaseException | None:
        """Wait for ``owner``'s commits started by :meth:`start_all` (none: at once); the error
        that ended the first that failed, or None."""
        errors = [s.result() for s in self._running.pop(owner, [])]
        return next((e for e in errors if e is not None), None)

    def in_flight(self) -> int:
        """Owners whose commits were started and not waited for (the engine's
        ``coli_commits_in_flight`` gauge, read at scrape time from another thread: one ``len`` of a
        dict, a single atomic read under the GIL)."""
        return len(self._running)

    def close(self) -> None:
        """Wait for every commit started, then stop the threads."""
        for owner in list(self._running):
            self.wait(owner)
        self._jobs.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclass
class _Job:
    """One owner's commits put off in a pass; ``overlap`` when every one of them allows it."""

    commits: list[Callable[[], object]]
    overlap: bool


@dataclass(frozen=True)
class _Started:
    """A started task: its future's result is an owner's error (None: it returned), or, with an
    ``index``, the list of every member's error of a task run for several owners."""

    future: Future[Any]
    overlap: bool
    index: int | None = None

    def result(self) -> BaseException | None:
        """The owner's error (None: its commits returned); waits for the task."""
        got = self.future.result()
        return got if self.index is None else got[self.index]  # type: ignore[no-any-return]


def _run_together(commits: list[BarrierCommit]) -> list[BaseException | None]:
    """Several owners' tail commits under one barrier (:func:`commit_together`): each owner's
    commit's error (None: it returned), in order; one task and one future for them all (a
    future per owner cost the engine loop one more object and lock per session per step)."""
    try:
        return commit_together(commits)
    except BaseException as exc:  # a bug: every owner's turn re-raises it rather than hang
        return [exc] * len(commits)


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
