"""Read-only file mappings whose unmapping never holds the GIL, and may run in the background.

Python 3.11's ``mmap.close`` keeps the GIL through ``munmap``, which takes ~1 ms per GB of
touched pages (the page tables of a resumed 32k-token GLM session map 1.4 GB). A
:class:`FileMapping` maps the file with libc's ``mmap`` through ctypes; numpy views and
memoryviews of :attr:`FileMapping.buffer` keep it alive, and when the last of them is gone a
finalizer runs ``munmap`` through ctypes (GIL released): in the dropping thread, or, after
:meth:`FileMapping.release` with ``defer=True``, in a background thread, so a session's
suspend does not wait for the page-table teardown. Where libc is not available, Python's
``mmap`` is used as before.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_unmapper: ThreadPoolExecutor | None = None
_unmapper_pid = -1
_unmapper_lock = threading.Lock()
_on_unmapper = threading.local()  # .yes on the unmapper thread: a finalizer there unmaps inline


def _mark_unmapper() -> None:
    _on_unmapper.yes = True


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_libc = _load_libc()
_MAP_FAILED = ctypes.c_void_p(-1).value
# ``populate``: the page tables filled in the mmap call itself (one kernel pass over the page cache) instead of
# by a fault per touched window; for a caller that reads every byte next (a resume hashes every record): a
# 32k-token GLM-5.2-shaped session's resume 1.03 -> 0.77x a raw read of the file (in process, medians of 8)
POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _background() -> ThreadPoolExecutor:
    global _unmapper, _unmapper_pid
    with _unmapper_lock:
        if _unmapper is None or _unmapper_pid != os.getpid():  # a forked child starts its own
            _unmapper = ThreadPoolExecutor(1, thread_name_prefix="coli-unmap", initializer=_mark_unmapper)
            _unmapper_pid = os.getpid()
        return _unmapper


def _unmap(address: int, size: int, state: dict[str, bool]) -> None:
    """The finalizer: munmap now (GIL released by ctypes) or hand it to the background."""
    if state["defer"] and not getattr(_on_unmapper, "yes", False):
        try:
            _background().submit(_libc.munmap, address, size)
            return
        except RuntimeError:  # interpreter shutting down: do it here
            pass
    _libc.munmap(address, size)


class FileMapping:
    """``size`` bytes of ``fd`` from offset 0, mapped read-only and shared.

    ``buffer`` is a read-only buffer (``np.frombuffer`` gives read-only arrays); every view
    keeps the mapping alive. ``release`` drops this object's reference. ``populate``: the page
    tables are filled by the mmap call (``MAP_POPULATE``; a file not in the page cache is read
    then), for a caller that reads every byte of it next.
    """

    def __init__(self, fd: int, size: int, *, populate: bool = False) -> None:
        self.size = size
        self._state = {"defer": False}
        if _libc is None:
            self.buffer: Any = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            self.address = 0
            return
        flags = mmap.MAP_SHARED | (POPULATE if populate else 0)
        address = _libc.mmap(None, size, mmap.PROT_READ, flags, fd, 0)
        if address is None or address == _MAP_FAILED:
            err = ctypes.get_errno() or errno.ENOMEM
            raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
        self.address = int(address)
        raw = (ctypes.c_char * size).from_address(self.address)
        weakref.finalize(raw, _unmap, self.address, size, self._state).atexit = False
        self.buffer = memoryview(raw).cast("B").toreadonly()  # views of it are read-only too

    def view(self, start: int, stop: int) -> memoryview:
        """Bytes [start, stop) as a read-only unsigned-byte memoryview (keeps the mapping)."""
        return memoryview(self.buffer)[start:stop]

    def drop_pages(self, start: int, length: int) -> None:
        """``madvise(MADV_DONTNEED)`` on a page-aligned range: the pages leave this process's
        page tables (a later access maps them again from the page cache)."""
        if length <= 0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        if _libc is None:
            self.buffer.madvise(mmap.MADV_DONTNEED, start, length)
        elif self.buffer is not None:
            _libc.madvise(self.address + start, length, mmap.MADV_DONTNEED)

    def release(self, *, defer: bool = False) -> None:
        """Drop this reference; the mapping goes when the last view goes (``defer``: its
        munmap then runs in a background thread)."""
        buffer, self.buffer = self.buffer, None
        if buffer is None:
            return
        self._state["defer"] = defer
        if isinstance(buffer, mmap.mmap):
            try:
                buffer.close()
            except BufferError:
                pass  # views still held: the mapping is released with the last of them


def release_later(box: list[Any], before: Callable[[], object] | None = None) -> None:
    """On the background thread: ``before()`` (e.g. a reader's close), then empty ``box``.
    What it held (a session's cache, buffers, views of a mapping) is freed there, so the
    caller does not wait for the ``free`` and ``munmap`` calls. The caller must hold no
    other reference to those objects."""

    def run() -> None:
        try:
            if before is not None:
                before()
        finally:
            box.clear()

    try:
        _background().submit(run)
    except RuntimeError:  # interpreter shutting down: free them here
        run()


def wait_for_unmaps() -> None:
    """Block until every deferred unmap of this process has run (tests, benchmarks)."""
    with _unmapper_lock:
        pool = _unmapper if _unmapper_pid == os.getpid() else None
    if pool is not None:
        pool.submit(lambda: None).result()


__all__ = ["FileMapping", "release_later", "wait_for_unmaps"]
