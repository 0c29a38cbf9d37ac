"""Who touches the sessions: exactly one piece of work at a time, the holder of the :class:`DecoderBaton`.

Every request's work runs in a thread of its own, and the baton, a fair (FIFO) lock, decides which
of them may touch the store and its sessions now. A turn holds it while it prepares (opens or
resumes its session, renders its prompt) and finishes (the last commit), and lets go of it
whenever it waits for the engine thread (:class:`~sessionstore.service.batcher.StepBatcher`): for
a forward, or for its whole decode loop, which that thread runs on between batched steps, holding
the baton itself while it samples, streams and commits for the turns. Arrival order decides who
goes next.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Ticket:
    """A parked holder of the baton: its thread and the lock it sleeps on."""

    ident: int
    wake: threading.Lock


class DecoderBaton:
    """A fair (FIFO) lock, released by its holder while it waits for the engine thread.

    The holder hands it straight to the first waiter (each waiter sleeps on a lock of its own),
    so a release wakes exactly one thread, not every waiter."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._waiting: deque[tuple[int, threading.Lock]] = deque()
        self._holder: int | None = None

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._mutex:
            if self._holder is None and not self._waiting:
                self._holder = me
                return
            wake = threading.Lock()
            wake.acquire()
            self._waiting.append((me, wake))
        wake.acquire()  # released by the holder that hands the baton to this thread

    def release(self) -> None:
        with self._mutex:
            assert self._holder == threading.get_ident(), "released by a thread that does not hold the baton"
            if not self._waiting:
                self._holder = None
                return
            self._holder, wake = self._waiting.popleft()
        wake.release()

    def park(self) -> Ticket:
        """The holder lets go of the baton and takes a ticket to sleep on (:meth:`wait`) until
        :meth:`admit` queues it again: it wakes holding the baton, once, and not before."""
        wake = threading.Lock()
        wake.acquire()
        ticket = Ticket(threading.get_ident(), wake)
        self.release()
        return ticket

    def admit(self, ticket: Ticket) -> None:
        """Queue a parked thread for the baton (called by the engine thread once its forward is
        done): handed the baton now if it is free, else after the threads already waiting."""
        with self._mutex:
            if self._holder is not None or self._waiting:
                self._waiting.append((ticket.ident, ticket.wake))
                return
            self._holder = ticket.ident
        ticket.wake.release()

    @staticmethod
    def wait(ticket: Ticket) -> None:
        """Sleep until admitted and handed the baton."""
        ticket.wake.acquire()

    def held_by_me(self) -> bool:
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
        with self._mutex:
            return len(self._waiting)


__all__ = ["DecoderBaton", "Ticket"]
