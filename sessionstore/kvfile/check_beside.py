"""A check that runs on a thread of its own while its caller goes on (a resume's checksum pass beside
its turn's first step, :func:`sessionstore.kvfile.integrity.start_vouching`).

The thread hashes with the GIL released (:func:`sessionstore.kvfile.sidecar.record_checksums`), so
the caller's compiled step and the pass share the cores. Whoever started the check owns it: it
must :meth:`PendingCheck.wait` for it before the memory the check reads goes away (a mapping
unmapped under the thread), and must take its :meth:`PendingCheck.result` (which raises what the
check raised) before anything that the check guards leaves the process.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")

MAX_CHECKS = 4  # passes that run at once (resumes of as many sessions); more wait for a thread
_pools: dict[str, tuple[int, ThreadPoolExecutor]] = {}  # name -> (pid, its threads), made on first use
_pools_lock = threading.Lock()


def _pool(name: str) -> ThreadPoolExecutor:
    """The threads that run the checks named ``name`` (each thread named so), kept between checks:
    a check is handed to a waiting thread instead of a new one whose start the caller waits for
    (``Thread.start`` waits until the thread runs: 20-30 ms on a loaded 2-vCPU host, measured in a
    32k resume). A forked child makes its own."""
    with _pools_lock:
        pid, pool = _pools.get(name, (-1, None))
        if pool is None or pid != os.getpid():
            pool = ThreadPoolExecutor(MAX_CHECKS, thread_name_prefix=name,
                                      initializer=lambda: setattr(threading.current_thread(), "name", name))
            _pools[name] = (os.getpid(), pool)
        return pool


class PendingCheck(Generic[T]):
    """``run()`` started at once on a thread of its own (one of the kept threads named ``name``);
    its value or its error kept for the owner."""

    def __init__(self, run: Callable[[], T], name: str = "coli-check") -> None:
        self._run: Callable[[], T] | None = run  # dropped once run: nothing it holds outlives the pass
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0  # how long ``run`` took on its thread (set once done)
        try:
            _pool(name).submit(self._main)
        except RuntimeError:  # the interpreter is shutting down: a thread of its own
            threading.Thread(target=self._main, name=name, daemon=True).start()

    def _main(self) -> None:
        t0 = time.perf_counter()
        run, self._run = self._run, None
        try:
            assert run is not None, "a PendingCheck runs once"
            self._value = run()
        except BaseException as exc:  # kept for the owner: raised by result()
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()

    def done(self) -> bool:
        """True once ``run`` has returned or raised."""
        return self._done.is_set()

    def passed(self) -> bool:
        """True once ``run`` has returned (not raised)."""
        return self._done.is_set() and self._error is None

    def wait(self) -> None:
        """Until ``run`` has returned or raised; raises nothing."""
        self._done.wait()

    def result(self) -> T:
        """``run``'s value, once it has returned (waits); what it raised, raised again."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # set when no error was kept


__all__ = ["PendingCheck"]
