"""The one replaceable I/O step of the append path (ZODB FileStorage style).

Every byte the writer puts on disk and every durability barrier goes through a
:class:`Durability` object: ``open``, ``pwrite``, ``fsync`` (``fsync_begin`` / ``fsync_all`` run
fsyncs concurrently in a helper thread), ``replace``, ``fsync_dir``, ``unlink``. Tests swap in a
:class:`FaultyDurability` that fails (``OSError``) or "crashes" (:class:`SimulatedCrash`, and
every later step crashes too) at step ``k``, optionally dropping writes that were never
fsynced (a power-loss model), then check that the files on disk reopen to a committed prefix.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import random
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")


def _load_sync_file_range():  # type: ignore[no-untyped-def]
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


class SimulatedCrash(Exception):
    """Raised by :class:`FaultyDurability` at the crash step and at every step after it."""


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
        """Write all of ``data`` at ``offset`` (loops over short writes)."""
        view = memoryview(data).cast("B")
        while len(view):
            done = os.pwrite(fd, view, offset)
            if done <= 0:
                raise OSError(errno.EIO, f"pwrite wrote {done} bytes at offset {offset}")
            view = view[done:]
            offset += done

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
        fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

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


# ------------------------------------------------------------------------------------------------
class FaultyDurability(Durability):
    """Counts steps; at step ``fail_at`` (0-based) fails or crashes.

    - ``mode="error"``: that one step raises ``OSError(EIO)`` without doing anything; later steps
      work again (a transient disk error).
    - ``mode="crash"``: that step and every later one raise :class:`SimulatedCrash` (the process
      is "dead"; nothing more reaches the disk). With ``lose_unsynced=True`` the crash also
      rolls every file written through this object back to its last fsynced content plus a random
      subset (seeded by ``seed``) of the writes made since (a power cut). Renames are taken as
      durable at once (a simplification: the writer fsyncs the directory right after each).
    - ``only``: count only these step names (e.g. ``{"fsync"}``); other steps run untouched.
    - ``real_sync=False`` skips the real fsync system calls (faster; nothing dies for real).
    ``steps`` lists the step names seen, so a first clean run tells how many steps a scenario has.
    """

    STEP_NAMES = ("open", "pwrite", "fsync", "replace", "fsync_dir", "unlink")

    def __init__(self, fail_at: int | None = None, *, mode: str = "crash",
                 only: set[str] | None = None, lose_unsynced: bool = False, seed: int = 0,
                 real_sync: bool = False) -> None:
        super().__init__()
        if mode not in ("error", "crash"):
            raise ValueError(f"mode must be 'error' or 'crash', not {mode!r}")
        self.fail_at = fail_at
        self.mode = mode
        self.only = only
        self.lose_unsynced = lose_unsynced
        self.rng = random.Random(seed)
        self.real_sync = real_sync
        self.steps: list[str] = []
        self.crashed = False
        self.failed_step: str | None = None
        self._count = 0
        self._lock = threading.Lock()
        self._fd_path: dict[int, str] = {}
        self._synced: dict[str, bytes] = {}  # path -> content at its last fsync
        self._journal: dict[str, list[tuple[int, bytes]]] = {}  # path -> writes since

    def _step(self, name: str) -> None:
        with self._lock:
            if self.crashed:
                raise SimulatedCrash(f"after crash: {name}")
            if self.only is not None and name not in self.only:
                return
            index = self._count
            self._count += 1
            self.steps.append(name)
            if index != self.fail_at:
                return
            self.failed_step = name
            if self.mode == "error":
                raise OSError(errno.EIO, f"injected I/O error at step {index} ({name})")
            self.crashed = True
        if self.lose_unsynced:
            self._power_cut()
        raise SimulatedCrash(f"crash at step {index} ({name})")

    # -- journal for the power-loss model -----------------------------------------------------------
    def _track(self, fd: int, path: str, created: bool) -> None:
        self._fd_path[fd] = path
        if path not in self._synced:
            try:
                with open(path, "rb") as f:
                    self._synced[path] = b"" if created else f.read()
            except OSError:
                self._synced[path] = b""
            self._journal[path] = []

    def _power_cut(self) -> None:
        for path, writes in self._journal.items():
            content = bytearray(self._synced[path])
            for offset, data in writes:
                if self.rng.random() < 0.5:
                    continue  # this write never reached the disk
                end = offset + len(data)
                if len(content) < end:
                    content.extend(b"\0" * (end - len(content)))
                content[offset:end] = data
            if os.path.exists(path):
                with open(path, "r+b") as f:
                    f.truncate(0)
                    f.write(content)

    # -- the steps ----------------------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._step("open")
        existed = os.path.exists(path)
        fd = super().open(path, flags, mode)
        self._track(fd, path, created=not existed or bool(flags & os.O_TRUNC))
        return fd

    def pwrite(self, fd: int, data: Buffer, offset: int) -> None:
        self._step("pwrite")
        super().pwrite(fd, data, offset)
        path = self._fd_path.get(fd)
        if path is not None:
            self._journal[path].append((offset, bytes(data)))

    def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int) -> None:
        self._step("pwrite")
        Durability.pwritev(self, fd, buffers, offset)
        path = self._fd_path.get(fd)
        if path is not None:
            for buf in buffers:
                self._journal[path].append((offset, bytes(buf)))
                offset += len(buf)

    def fsync(self, fd: int) -> None:
        self._step("fsync")
        if self.real_sync:
            os.fdatasync(fd)
        path = self._fd_path.get(fd)
        if path is not None:
            with open(path, "rb") as f:
                self._synced[path] = f.read()
            self._journal[path] = []

    def begin(self, fn: Callable[..., T], *args: object) -> Callable[[], T]:
        result = fn(*args)  # at once, in this thread: step numbers stay deterministic
        return lambda: result

    def fsync_all(self, fds: Sequence[int]) -> None:
        for fd in fds:
            self.fsync(fd)

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        pass  # a hint only: the power-cut model must not treat it as a barrier

    def replace(self, src: str, dst: str) -> None:
        self._step("replace")
        os.replace(src, dst)
        if src in self._synced:
            self._synced[dst] = self._synced.pop(src)
            self._journal[dst] = self._journal.pop(src)
            for fd, path in self._fd_path.items():
                if path == src:
                    self._fd_path[fd] = dst

    def fsync_dir(self, path: str) -> None:
        self._step("fsync_dir")
        if self.real_sync:
            Durability.fsync_dir(self, path)

    def unlink(self, path: str) -> None:
        self._step("unlink")
        os.unlink(path)
        self._synced.pop(path, None)
        self._journal.pop(path, None)


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



def count_steps(scenario: Callable[[Durability], object], **kwargs: object) -> list[str]:
    """Run ``scenario`` with a counting (never failing) FaultyDurability; the step names it took."""
    probe = FaultyDurability(None, **kwargs)  # type: ignore[arg-type]
    scenario(probe)
    return probe.steps


__all__ = ["Durability", "FaultyDurability", "SharedDurability", "SimulatedCrash", "count_steps", "DEFAULT_DURABILITY"]
