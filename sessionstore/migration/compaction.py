"""Background work of the write-through shipper (FORMAT.md 6.7.3): compacting a chain into a whole
base bundle, and deleting what a compaction replaced, off the turn's path; and when a chain is due
for it (:func:`compaction_due`).

:class:`Compactor` is one daemon thread over a bounded queue of jobs, at most one queued per key
(a session): a turn's ship only *requests* a compaction (it never waits for one), and a request
that finds the queue full or the session already queued is dropped (the next ship asks again
while the chain is still due). A job that raises is logged and forgotten: the chain it worked on
is left as it was, which is always a complete chain (the head moves last, conditionally).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from sessionstore.log import get_logger
from sessionstore.migration.segment_format import MAX_CHAIN_SEGMENTS, Head

COMPACT_MIN_BYTES = 4 << 20  # segments below this total never trigger a compaction by size
COMPACT_SEGMENTS = MAX_CHAIN_SEGMENTS // 2  # a chain this long is compacted in the background
MAX_QUEUED = 64  # sessions waiting for background work; more requests are dropped until it drains

log = get_logger("remote")


def compaction_due(chain: Head, record_bytes: int) -> bool:
    """Compaction: the chain is long, or its segments outweigh its base."""
    return chain.count >= COMPACT_SEGMENTS or (
        chain.segment_bytes >= COMPACT_MIN_BYTES and chain.segment_bytes >= chain.base_tokens * record_bytes)


@dataclass(frozen=True)
class PreparedBase:
    """A whole bundle a compaction uploaded that the head does not name yet: records ``[0, nrec)``
    of the commit of manifest ``epoch``, under lease ``generation``. The next ship of that chain
    starts its segment at ``nrec`` on top of it (the chain moved on while it was written)."""

    key: str
    nrec: int
    epoch: int
    generation: int


class Compactor:
    """One background thread running jobs from a bounded queue, one queued job per key."""

    def __init__(self, *, max_queued: int = MAX_QUEUED, name: str = "coli-ship-compactor") -> None:
        self._queue: queue.Queue[tuple[str, Callable[[], object]] | None] = queue.Queue(maxsize=max_queued)
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._name = name
        self._thread: threading.Thread | None = None
        self._stopped = False

    def request(self, key: str, job: Callable[[], object]) -> bool:
        """Queue ``job`` for ``key`` unless one is queued for it already or the queue is full
        (False: dropped). Never blocks."""
        with self._lock:
            if self._stopped or key in self._queued:
                return False
            try:
                self._queue.put_nowait((key, job))
            except queue.Full:
                log.info("ship.compaction_dropped", id=key, reason="queue full")
                return False
            self._queued.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, job = item
                with self._lock:
                    self._queued.discard(key)  # a ship during the job may ask again
                try:
                    job()
                except Exception as exc:  # one failed job is logged; the chain stays as it was
                    log.warning("ship.compaction_failed", id=key, error=str(exc))
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every job queued so far has run."""
        self._queue.join()

    def stop(self, timeout: float = 30.0) -> None:
        """Run what is queued, then end the thread (waiting at most ``timeout`` seconds)."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        if thread is not None:
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                return  # a daemon thread: it ends with the process
            thread.join(timeout)


__all__ = ["COMPACT_MIN_BYTES", "COMPACT_SEGMENTS", "MAX_QUEUED", "Compactor", "PreparedBase", "compaction_due"]
