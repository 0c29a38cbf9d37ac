"""The zero-filled headroom a session's writer keeps past its committed records (FORMAT.md 3.4.1).

Small commits (a decode loop) then overwrite allocated, initialised blocks, so their data
barrier (fdatasync) has no metadata (size, extents) to commit. The headroom is a stale tail:
bytes past nrec, never read as records.
"""
from __future__ import annotations

import numpy as np

from sessionstore.kvfile.durability import Durability
from sessionstore.log import get_logger

PREALLOC_RECORDS = 256  # zero-filled headroom, in records ...
PREALLOC_MAX_BYTES = 8 << 20  # ... at most this many bytes (the default ``preallocate``)
PREALLOC_SMALL_COMMIT = 8  # only commits of <= 1/8 of the headroom refill it
PAGE = 4096

log = get_logger("writer")


def default_headroom(record_bytes: int) -> int:
    """The decode loop's headroom (``preallocate=None``): min(256 records, 8 MiB)."""
    return min(PREALLOC_MAX_BYTES, PREALLOC_RECORDS * record_bytes)


class Headroom:
    """One writer's headroom policy: ``preallocate`` bytes (None: :func:`default_headroom`,
    0: off, as the engine writes files)."""

    def __init__(self, preallocate: int | None) -> None:
        self.preallocate = preallocate

    @property
    def enabled(self) -> bool:
        return self.preallocate != 0

    def size(self, record_bytes: int) -> int:
        return default_headroom(record_bytes) if self.preallocate is None else self.preallocate

    def refill(self, io: Durability, fd: int, path: str, *, committed_end: int, file_end: int,
               added: int, record_bytes: int) -> int:
        """After a commit (the commit point is behind us); returns the file's new end.

        Runs when a small commit (at most 1/PREALLOC_SMALL_COMMIT of the headroom) leaves less
        than half the headroom: zeros up to committed end + headroom (page aligned), written
        without waiting (write-back starts at once, so the disk does it while the model
        computes the next token). Streaming commits get none: their bytes dwarf the metadata
        cost, and zeros first would double their I/O. A failed write (ENOSPC) only turns the
        headroom off.
        """
        headroom = self.size(record_bytes)
        if headroom <= 0 or added * record_bytes * PREALLOC_SMALL_COMMIT > headroom:
            return file_end
        if file_end - committed_end >= headroom // 2:
            return file_end
        start = max(file_end, committed_end)
        target = -(-(committed_end + headroom) // PAGE) * PAGE  # page-aligned new end of the file
        try:
            io.pwrite(fd, np.zeros(target - start, dtype=np.uint8).data, start)  # calloc'ed
            io.start_writeback(fd, start, target - start)
        except OSError as exc:
            self.preallocate = 0
            log.warning("kv.preallocate_failed", path=path, error=str(exc),
                        action="preallocation off for this writer")
            return file_end
        log.info("kv.preallocate", path=path, start=start, bytes=target - start)
        return target


__all__ = ["Headroom", "PREALLOC_MAX_BYTES", "PREALLOC_RECORDS", "PREALLOC_SMALL_COMMIT", "default_headroom"]
