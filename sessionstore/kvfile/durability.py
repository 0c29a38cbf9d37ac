"""The one replaceable I/O step of the append path (ZODB FileStorage style).

Every byte the writer puts on disk and every durability barrier goes through a
:class:`Durability` object: ``open``, ``pwrite``, ``fsync`` (``fsync_begin`` / ``fsync_all`` run
fsyncs concurrently in a helper thread), ``replace``, ``fsync_dir``, ``unlink``. Tests swap in
:class:`sessionstore.testing.FaultyDurability`, which fails or "crashes" at a chosen step.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from sessionstore.kvfile.fsio import Buffer, fsync_parent, pwrite_all

T = TypeVar("T")


def _load_sync_file_range() -> Any:  # the libc function, or None
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = _load_sync_file_range()


class Durability:
    """Real I/O. Subclass and override single steps to inject faults."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = -1
        self._pool_lock = threading.Lock()

    # -- the steps ----------------------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags | os.O_CLOEXEC, mode)

    def pwrite(self, fd: int, data: Buffer, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (loops over short writes: :func:`fsio.pwrite_all`)."""
        pwrite_all(fd, data, offset)

    def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int) -> None:
        """Write the buffers back to back at ``offset`` (one syscall per batch when possible)."""
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        while views:
            done = os.pwritev(fd, views[:512], offset)
            if done <= 0:
                raise OSError(errno.EIO, f"pwritev wrote {done} bytes at offset {offset}")
            offset += done
            while views and done >= len(views[0]):
                done -= len(views[0])
                views.pop(0)
            if done:
                views[0] = views[0][done:]

    def fsync(self, fd: int) -> None:
        """The durability barrier for a regular file's data (and the size needed to read it)."""
        os.fdatasync(fd)

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        """Hint: start writing this range to disk now, without waiting (no durability promise).

        Lets the disk work while the caller packs more records, so the commit's barrier has
        little left to wait for. Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; else nothing.
        """
        if _sync_file_range is not None:
            _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)

    def begin(self, fn: Callable[..., T], *args: object) -> Callable[[], T]:
        """Start ``fn(*args)`` in the helper thread; returns the call that waits for it (and
        raises its error). The writer fsyncs the sidecar beside the data this way."""
        future: Future[T] = self._helper().submit(fn, *args)
        return future.result

    def fsync_begin(self, fd: int) -> Callable[[], None]:
        """Start ``fsync(fd)`` in the helper thread (see :meth:`begin`)."""
        return self.begin(self.fsync, fd)

    def fsync_all(self, fds: Sequence[int]) -> None:
        """fsync every fd; the first in this thread, the others concurrently in the helper.

        All are waited for; the first failure is raised after every fsync has finished.
        """
        waits = [self.fsync_begin(fd) for fd in fds[1:]]
        error: BaseException | None = None
        try:
            for fd in fds[:1]:
                self.fsync(fd)
        except BaseException as exc:  # wait for the helpers before raising
            error = exc
        for wait in waits:
            try:
                wait()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        """fsync the directory that holds ``path`` (makes a new name or a rename durable)."""
        fsync_parent(path)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    # -- helper thread ------------------------------------------------------------------------
    def _helper(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None or self._pool_pid != os.getpid():  # a forked child re-creates it
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="coli-fsync")
                self._pool_pid = os.getpid()
            return self._pool

    def release(self) -> None:
        """Stop the helper thread (the writer calls this on close; it restarts on demand)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
            if pool is not None and self._pool_pid == os.getpid():
                pool.shutdown(wait=True)


DEFAULT_DURABILITY = Durability


HELPER_THREADS = 4  # shared fsync helpers (one per concurrent commit is plenty)
_helpers: ThreadPoolExecutor | None = None
_helpers_pid = -1
_helpers_lock = threading.Lock()


def _helper_pool() -> ThreadPoolExecutor:
    """The process's fsync helper threads, started once (again in a forked child) and shared by
    every writer: a session that is suspended and resumed never pays for a thread start."""
    global _helpers, _helpers_pid
    with _helpers_lock:
        if _helpers is None or _helpers_pid != os.getpid():
            _helpers = ThreadPoolExecutor(HELPER_THREADS, thread_name_prefix="coli-fsync")
            _helpers_pid = os.getpid()
        return _helpers


class SharedDurability(Durability):
    """The default I/O object of a writer: real I/O, fsyncs overlapped on the shared helpers."""

    def begin(self, fn: Callable[..., T], *args: object) -> Callable[[], T]:
        return _helper_pool().submit(fn, *args).result

    def release(self) -> None:
        """Nothing to stop: the helpers are shared and stay up for the next writer."""


def wait_all(waits: list[Callable[[], object]], *, quiet: bool = False) -> None:
    """Wait for every helper's barrier, then raise the first error (``quiet``: none, the
    caller's own error is propagating)."""
    error: BaseException | None = None
    for wait in waits:
        try:
            wait()
        except BaseException as exc:  # the others must still be waited for
            error = error or exc
    if error is not None and not quiet:
        raise error


__all__ = ["Durability", "SharedDurability", "DEFAULT_DURABILITY"]
