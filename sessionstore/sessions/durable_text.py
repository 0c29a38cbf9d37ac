"""Durable streaming (``--durable-stream``): a turn's text is held until the commit that covers
its tokens has returned, so nothing a client was sent can be lost by a crash.

A session in durable-stream mode commits at every token (:meth:`Session.generate`, unless a
commit is in flight: the next one covers the tokens drawn meanwhile). Its kv file is committed as
without it, every ``commit_every`` records (records, commit word, state page, each made durable);
every other such commit is a **tail commit** (:meth:`~sessionstore.sessions.session_commits.CommitPath.begin_tail`): the
commit state page alone, one ``pwrite`` and one fdatasync, with ``committed`` and ``last_logits``
those of the last kv commit and ``pending`` the tail, every token after its records (the ones fed
since, then the one just drawn). A token is durable once its id is: chunked prefill is bitwise
invariant, so a reopen feeds the whole tail and continues exactly (FORMAT.md 5.5). A tail longer
than ``MAX_PENDING`` is a kv commit instead; the page's two slots keep the last tail readable when
a crash tears the next one (FORMAT.md 5.3.1).

The text of a token is emitted by the turn's output processor while the token is drawn, before its
commit; :class:`HeldText` sits between that processor and the client: each piece is held,
:meth:`HeldText.mark` (taken by the session when a commit's first part fixes what it covers) counts
the pieces emitted so far, and :meth:`HeldText.committed` (called once that commit has returned)
sends every piece up to that mark, in order. A commit that fails sends nothing: the client never
sees text the store does not hold.

In a server the commits of one decode step run together, beside the next step
(:mod:`sessionstore.service.steps.group_commit`), so a stream waits one commit per step, not one per
token, and the text of step k goes out while step k+1 computes.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from sessionstore.sessions.session_options import SessionOptions

DURABLE_STREAM = True  # the default of ``serve`` and ``chat`` (--no-durable-stream turns it off; issue 39)


class CommitWatch(Protocol):
    """What a session tells about its commits (a :class:`HeldText` is one)."""

    def mark(self) -> int:
        """Called when a commit's first part fixed what it covers: a mark of what was emitted so far."""
        ...

    def committed(self, mark: int) -> None:
        """Called once the commit that took ``mark`` has returned (its records and state are durable)."""
        ...


class HeldText:
    """Text pieces (and whatever else the sink takes with them) held until a commit covers them.

    ``emit(*args)`` is the real sink; :meth:`hold` is what the turn's output processor calls
    instead. Thread-safe: a commit may return on a helper thread while the turn's loop runs on."""

    def __init__(self, emit: Callable[..., None]) -> None:
        self._emit = emit
        self._lock = threading.Lock()
        self._held: list[tuple[Any, ...]] = []  # pieces not sent yet, oldest first
        self._sent = 0  # pieces sent so far (the index of self._held[0] among every piece held)
        self.released = 0  # commits that released something (a figure for tests)

    def hold(self, *args: Any) -> None:
        """Hold one piece (``emit``'s arguments) until a commit covers it."""
        with self._lock:
            self._held.append(args)

    def mark(self) -> int:
        with self._lock:
            return self._sent + len(self._held)

    def committed(self, mark: int) -> None:
        """Send every held piece up to ``mark`` (pieces held after the mark wait for a later commit).
        The pieces are sent under the lock, so two commits' releases never interleave."""
        with self._lock:
            count = mark - self._sent
            if count <= 0:
                return
            out, self._held = self._held[:count], self._held[count:]
            self._sent += len(out)
            self.released += 1
            for args in out:
                self._emit(*args)

    def release_all(self) -> None:
        """The turn ended with its last commit returned: send what is left (the output processor's
        final pieces, e.g. text a stop string's prefix held back)."""
        self.committed(self.mark())

    @property
    def waiting(self) -> int:
        """Pieces held and not sent."""
        with self._lock:
            return len(self._held)


class Watched(Protocol):
    """A session as :func:`held_until_committed` uses it."""

    options: SessionOptions
    commit_watch: CommitWatch | None


@contextmanager
def held_until_committed(session: Watched, emit: Callable[..., None]) -> Iterator[Callable[..., None]]:
    """What a turn on ``session`` emits its text to: ``emit`` itself, or, in durable-stream mode,
    the ``hold`` of a :class:`HeldText` watching the session's commits (each piece is passed to
    ``emit`` once a commit covering it has returned). A turn that ends normally made its last
    commit, so what is left goes out when the block ends; one that raises sends nothing more."""
    if not session.options.durable_stream:
        yield emit
        return
    held = HeldText(emit)
    session.commit_watch = held
    try:
        yield held.hold
    finally:
        session.commit_watch = None
    held.release_all()


__all__ = ["DURABLE_STREAM", "CommitWatch", "HeldText", "Watched", "held_until_committed"]
