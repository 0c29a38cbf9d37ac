"""Who holds the decoder: exactly one piece of work at a time, handed on at token boundaries.

Every request's work runs in a thread of its own, but only the holder of the :class:`DecoderBaton`
touches the decoder or a session. A turn offers the baton at each token boundary
(:meth:`DecoderBaton.offer`): when other work waits, the longest waiting one takes it and the turn
queues again behind the others, so concurrent sessions advance one token each in turn (arrival
order) and a long reply never holds the others back. Sessions are not batched into one forward:
the decoder's matmuls over a batch are not bitwise equal to the rows computed alone, and a
session's tokens must not depend on who else is decoding.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager


class DecoderBaton:
    """A fair (FIFO) lock that its holder can hand on at a token boundary."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: deque[int] = deque()
        self._holder: int | None = None
        self.handoffs = 0  # times the decoder passed from one piece of work to another at a token

    def _wait_for_turn(self, me: int) -> None:
        self._waiting.append(me)
        self._cond.wait_for(lambda: self._holder is None and self._waiting[0] == me)
        self._waiting.popleft()
        self._holder = me

    def acquire(self) -> None:
        with self._cond:
            self._wait_for_turn(threading.get_ident())

    def release(self) -> None:
        with self._cond:
            assert self._holder == threading.get_ident(), "released by a thread that does not hold the decoder"
            self._holder = None
            self._cond.notify_all()

    def offer(self) -> None:
        """At a token boundary: let the longest waiting work run first, then continue."""
        me = threading.get_ident()
        with self._cond:
            assert self._holder == me, "offered by a thread that does not hold the decoder"
            if not self._waiting:
                return
            self.handoffs += 1
            self._holder = None
            self._cond.notify_all()
            self._wait_for_turn(me)

    @contextmanager
    def held(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)


__all__ = ["DecoderBaton"]
