"""A second thread of this process that hashes a share of a resume's records while the caller hashes the rest.

A resume checks every record its sidecar vouches for and gathers the records' scales in the same pass
(:func:`sessionstore.kvfile.integrity.require_vouched`). xxhash (>= 3.0, "always release GIL") hashes
with the GIL released, and the pass spends nearly all its time inside those calls, so a thread of this
process can hash the last part of the range, gathering that part's scales while each block is in *its*
core's cache. Unlike the helper process (:mod:`.hash_helper`) nothing is gathered cold afterwards and
nothing crosses a pipe. A host with one usable CPU, or a small range, keeps the pass on one thread.

The thread is one per process (a fork starts its own), made on first use and kept: a resume pays no
thread start.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

MIN_THREADED_BYTES = 64 << 20  # a range below this is hashed by the caller alone (the hand-over costs ~0.1 ms)
THREAD_SHARE = 0.5  # of a range's records, the second thread takes the last this fraction

_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threaded_split(records: int, record_bytes: int) -> int:
    """Where the caller's share of records [0, records) ends: ``records`` (no split) when the
    range is under MIN_THREADED_BYTES or only one CPU is usable; else the second thread hashes
    [split, records)."""
    if records * record_bytes < MIN_THREADED_BYTES or usable_cpus() < 2:
        return records
    return int(records * (1.0 - THREAD_SHARE))


def hash_thread() -> ThreadPoolExecutor:
    """The process's one hashing thread (made on first use; a forked child makes its own)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(1, thread_name_prefix="coli-hash")
            _pool_pid = os.getpid()
        return _pool


__all__ = ["MIN_THREADED_BYTES", "THREAD_SHARE", "hash_thread", "threaded_split", "usable_cpus"]
