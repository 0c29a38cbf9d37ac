"""``IoStarter`` s for tests of a session whose files are made while its first turn runs
(:meth:`sessionstore.sessions.session.Session.create` with ``io_start``): one on a real thread
whose making can be held back (:class:`HeldStarter`, a slow disk on purpose), and deterministic
ones that run the making on the session's own thread at a chosen moment (:class:`DeferredStarter`,
for the crash-state explorer, which records one thread's file operations in order)."""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class HeldStarter:
    """Runs each making on an I/O thread, after ``gate`` is set (or ``hold_s`` has passed):
    a creation whose fsyncs take that long. ``started``/``finished`` count makings."""

    def __init__(self, *, hold_s: float = 10.0) -> None:
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="test-start")
        self.gate = threading.Event()
        self.hold_s = hold_s
        self.finished = threading.Event()
        self.held_until_gate = False

    def __call__(self, fn: Callable[[], T]) -> Future[T]:
        def held() -> T:
            self.held_until_gate = self.gate.wait(self.hold_s)
            try:
                return fn()
            finally:
                self.finished.set()

        return self.pool.submit(held)

    def close(self) -> None:
        self.gate.set()
        self.pool.shutdown(wait=True)


class _Deferred(Future):  # type: ignore[type-arg]
    """A future whose function runs on the thread that first asks for it (``done()`` too
    when ``on_poll``): the making happens at that exact point of the session's own work."""

    def __init__(self, fn: Callable[[], Any], on_poll: bool) -> None:
        super().__init__()
        self._fn: Callable[[], Any] | None = fn
        self._on_poll = on_poll

    def _run(self) -> None:
        fn, self._fn = self._fn, None
        if fn is None:
            return
        try:
            self.set_result(fn())
        except BaseException as exc:  # handed to whoever waits, as a thread's future would
            self.set_exception(exc)

    def done(self) -> bool:
        if self._on_poll:
            self._run()
        return super().done()

    def result(self, timeout: float | None = None) -> Any:
        self._run()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._run()
        return super().exception(timeout)


class DeferredStarter:
    """Makes a new session's files on its own thread: at the first poll (``on_poll``: after its
    prompt's prefill, when the rows would be handed over) or at the first wait (its first commit)."""

    def __init__(self, *, on_poll: bool) -> None:
        self.on_poll = on_poll

    def __call__(self, fn: Callable[[], T]) -> Future[T]:
        return _Deferred(fn, self.on_poll)
