"""The engine's session claims (FORMAT.md 7, the busy rule): which request holds each session, and
the requests waiting for a session whose holder's turn has ended.

A request's work holds its session's claim from the moment it is accepted until it has run. A request
on a session held by a turn still generating is refused at once with 409 ``session_busy``. A request on a
session held by a turn that has ENDED (its last token drawn, or its client gone: it only commits and
writes what follows, e.g. a conversation's items) waits for that claim's release instead, at most
:data:`CLAIM_WAIT_S`, behind the requests that waited before it, and is then started holding the claim;
past the bound it gets the same 409. Nothing blocks while it waits: :meth:`Claims.take_or_wait` returns
a future at once (the thread that receives requests calls it), and the release that frees the claim
(the engine loop's job, as its work ends) hands it to the first waiter and starts that waiter's work.
:meth:`Claims.close` (shutdown) fails every waiter with 503 at once."""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sessionstore.service.errors import ApiError

# how long a request waits for a session held by an ended turn (committing, writing its conversation's
# items) before it gets 409: a turn's last commit and writes take milliseconds to a few hundred
CLAIM_WAIT_S = 5.0

Start = Callable[[], "Future[Any]"]  # starts a request's work once it holds the claim; its outcome


def busy(session_id: str) -> ApiError:
    """The 409 of a request on a session another request holds."""
    return ApiError(409, f"session {session_id!r} is busy with another request; retry when it has finished",
                    code="session_busy")


@dataclass(eq=False)
class Claim:
    """One request's hold on a session. ``cut``: asked whether the holder's client has gone (its
    stream cut); :meth:`Claims.end` marks a turn whose last token is drawn."""

    cut: Callable[[], bool] | None = None
    ended: bool = False

    def has_ended(self) -> bool:
        """The holder only commits and writes now: its turn drew its last token, or its client went."""
        return self.ended or (self.cut is not None and self.cut())


@dataclass(eq=False)
class _Waiter:
    """A request waiting for a session: started with ``start`` holding ``claim``; its outcome in ``future``."""

    start: Start
    claim: Claim
    future: Future[Any] = field(default_factory=Future)
    timer: threading.Timer | None = None


class Claims:
    """Every session's claim and its waiters, under one lock (any thread may take, end or release)."""

    def __init__(self, wait_s: float = CLAIM_WAIT_S) -> None:
        self.wait_s = wait_s  # the bound on a wait (seconds)
        self._lock = threading.Lock()
        self._held: dict[str, Claim] = {}
        self._waiting: dict[str, deque[_Waiter]] = {}
        self._closed = False

    def take(self, session_id: str, cut: Callable[[], bool] | None = None) -> Claim:
        """Hold ``session_id`` now, or refuse with 409 while another request holds it."""
        with self._lock:
            if session_id in self._held:
                raise busy(session_id)
            claim = self._held[session_id] = Claim(cut)
            return claim

    def take_or_wait(self, session_id: str, start: Start, cut: Callable[[], bool] | None = None) -> Future[Any]:
        """Run ``start`` holding ``session_id``: now when it is free (its future returned); when an
        ended turn holds it, once that releases it (a future settled then: ``start``'s outcome, or 409
        past the bound, or 503 at shutdown); while a turn still generating holds it, 409 raised now."""
        with self._lock:
            holder = self._held.get(session_id)
            if holder is None:
                self._held[session_id] = Claim(cut)
                waiter = None
            elif not holder.has_ended() or self._closed:
                raise busy(session_id)
            else:
                waiter = _Waiter(start, Claim(cut))
                self._waiting.setdefault(session_id, deque()).append(waiter)
                waiter.timer = threading.Timer(self.wait_s, self._expire, (session_id, waiter))
                waiter.timer.daemon = True
                waiter.timer.start()
        if waiter is None:
            try:
                return start()
            except BaseException:
                self.release(session_id)
                raise
        return waiter.future

    def held(self, session_id: str) -> bool:
        """Whether a request holds ``session_id`` now."""
        with self._lock:
            return session_id in self._held

    def end(self, session_id: str) -> None:
        """The turn holding ``session_id`` drew its last token (called by that turn's job)."""
        with self._lock:
            claim = self._held.get(session_id)
            if claim is not None:
                claim.ended = True

    def release(self, session_id: str | None) -> None:
        """Free ``session_id``: handed to its first waiter (whose work starts here), else free."""
        while session_id is not None:
            with self._lock:
                queue = self._waiting.get(session_id)
                if not queue:
                    self._held.pop(session_id, None)
                    return
                waiter = queue.popleft()
                if not queue:
                    del self._waiting[session_id]
                self._held[session_id] = waiter.claim
            if waiter.timer is not None:
                waiter.timer.cancel()
            if self._run(waiter):
                return  # the waiter holds the claim now, until its work releases it

    def close(self) -> None:
        """Shutdown: every waiter fails with 503 now; later requests on a held session get 409."""
        with self._lock:
            self._closed = True
            waiters = [w for queue in self._waiting.values() for w in queue]
            self._waiting.clear()
        for waiter in waiters:
            if waiter.timer is not None:
                waiter.timer.cancel()
            waiter.future.set_exception(ApiError(503, "the server is shutting down", code="shutting_down"))

    def _run(self, waiter: _Waiter) -> bool:
        """Start a waiter that now holds its claim; False when it failed to start (then still held)."""
        try:
            inner = waiter.start()
        except BaseException as exc:  # refused (shutting down): its outcome; the claim goes on
            waiter.future.set_exception(exc)
            return False

        def settle(done: Future[Any]) -> None:
            error = done.exception()
            if error is not None:
                waiter.future.set_exception(error)
            else:
                waiter.future.set_result(done.result())

        inner.add_done_callback(settle)
        return True

    def _expire(self, session_id: str, waiter: _Waiter) -> None:
        """The timer of a waiter not started within the bound: 409, as if it had found the session busy."""
        with self._lock:
            queue = self._waiting.get(session_id)
            if queue is None or waiter not in queue:
                return  # started (or failed at shutdown) meanwhile
            queue.remove(waiter)
            if not queue:
                del self._waiting[session_id]
        waiter.future.set_exception(busy(session_id))


__all__ = ["CLAIM_WAIT_S", "Claim", "Claims", "busy"]
