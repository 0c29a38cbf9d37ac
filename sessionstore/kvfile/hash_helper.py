"""A second process that hashes a share of a file's records while this one hashes the rest.

A resume checks every record it vouches for (FORMAT.md 4.4): for a 32k-token GLM-5.2 session
that is 1.4 GB of xxh3, most of the resume's time. The xxhash binding holds the GIL while it
hashes, so a second thread adds nothing; a second process does. A long-running server starts one
helper (:func:`start_hash_helper`); :func:`sessionstore.kvfile.integrity.require_vouched` then
hands it the tail of every large range and compares its checksums like its own.

The helper opens the file by path and hashes only if it is the very file the reader mapped (same
device and inode); any failure of the helper (gone, another file, an error) falls back to hashing
that share here, so no record is ever used unchecked.
"""
from __future__ import annotations

import mmap
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import numpy as np
import xxhash

from sessionstore.log import get_logger

log = get_logger("kvfile")

MIN_SHARED_BYTES = 64 << 20  # a range below this is hashed here alone (the hand-over costs ~ms)
HELPER_SHARE = 0.5  # of a range's records, the helper hashes the last this fraction
PARENT_POLL_S = 0.25  # how often the helper checks that its parent still lives


def hash_file_records(path: str, identity: tuple[int, int], offset: int, record_bytes: int,
                      start: int, stop: int) -> bytes:
    """In the helper: the xxh3_64 checksums of records [start, stop) of the file at ``path``
    (record r at ``offset + r * record_bytes``, seeded with r), as <u8 bytes; refuses a file
    that is not ``identity`` (st_dev, st_ino)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != identity:
            raise FileNotFoundError(f"{path}: not the file the reader mapped (replaced meanwhile)")
        lo, hi = offset + start * record_bytes, offset + stop * record_bytes
        base = lo - lo % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(fd, hi - base, access=mmap.ACCESS_READ, offset=base) as mapped:
            view = memoryview(mapped)
            try:
                out = np.empty(stop - start, dtype="<u8")  # [k] u64
                for i, r in enumerate(range(start, stop)):
                    at = lo - base + i * record_bytes
                    out[i] = xxhash.xxh3_64_intdigest(view[at:at + record_bytes], seed=r)
                return out.tobytes()
            finally:
                view.release()
    finally:
        os.close(fd)


def _ready() -> bool:
    return True


def _serve_parent(parent: int) -> None:
    """The helper's start: it leaves interrupts to its parent (a Ctrl-C reaches the whole
    process group) and exits as soon as its parent is gone (killed, say), never outliving it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="coli-hash-parent", daemon=True).start()


class HashHelper:
    """One helper process; :meth:`submit` hashes a range there, :meth:`close` ends it."""

    def __init__(self) -> None:
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn"), initializer=_serve_parent,
                                         initargs=(os.getpid(),))
        self._pool.submit(_ready)  # starts the process now, not on the first resume

    def submit(self, path: str, identity: tuple[int, int], offset: int, record_bytes: int,
               start: int, stop: int) -> Callable[[], np.ndarray | None]:
        """Start hashing [start, stop) in the helper; returns the call that waits for the
        checksums [k] <u8, or None when the helper could not give them (the caller hashes)."""
        try:
            future = self._pool.submit(hash_file_records, path, identity, offset, record_bytes, start, stop)
        except Exception as exc:  # a broken pool: hashed by the caller
            log.warning("kv.hash_helper_failed", path=path, error=str(exc))
            return lambda: None

        def result() -> np.ndarray | None:
            try:
                return np.frombuffer(future.result(), dtype="<u8")
            except Exception as exc:  # hashed by the caller instead
                log.warning("kv.hash_helper_failed", path=path, error=str(exc))
                return None

        return result

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


_lock = threading.Lock()
_helper: HashHelper | None = None


def start_hash_helper() -> HashHelper:
    """Start this process's helper (once; a long-running server calls it at start)."""
    global _helper
    with _lock:
        if _helper is None:
            _helper = HashHelper()
        return _helper


def stop_hash_helper() -> None:
    global _helper
    with _lock:
        helper, _helper = _helper, None
    if helper is not None:
        helper.close()


def active_hash_helper() -> HashHelper | None:
    return _helper


__all__ = ["HELPER_SHARE", "MIN_SHARED_BYTES", "HashHelper", "active_hash_helper", "hash_file_records",
           "start_hash_helper", "stop_hash_helper"]
