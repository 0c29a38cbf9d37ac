"""Who touches the sessions: exactly one turn at a time, the holder of the :class:`DecoderBaton`.

Every request's work runs in a thread of its own, and the baton, a fair (FIFO) lock, decides which
of them may touch the store and its sessions now. A turn holds it while it samples, streams and
commits, and lets go of it whenever it waits for the engine thread to run its next forward
(:class:`~sessionstore.service.batcher.StepBatcher`): the other turns take their tokens meanwhile,
and their next steps join the same batched forward. Arrival order decides who goes next.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager


class DecoderBaton:
    """A fair (FIFO) lock, released by its holder while it waits for the engine thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: deque[int] = deque()
        self._holder: int | None = None

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._cond:
            self._waiting.append(me)
            self._cond.wait_for(lambda: self._holder is None and self._waiting[0] == me)
            self._waiting.popleft()
            self._holder = me

    def release(self) -> None:
        with self._cond:
            assert self._holder == threading.get_ident(), "released by a thread that does not hold the baton"
            self._holder = None
            self._cond.notify_all()

    def held_by_me(self) -> bool:
        with self._cond:
            return self._holder == threading.get_ident()

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
