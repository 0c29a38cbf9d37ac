"""A writer's staging buffer: appended records not yet committed, in position order.

Chunks of ``capacity`` packed records, filled in order, written to the writer's file and
sidecar when the writer says so (``write_records``, ``write_entries``; never an fsync); a batch
of at least ``capacity / 8`` records becomes a chunk of its own (no copy).
``written`` counts the leading staged records the writer has already put in the file (early,
without fsync), ``entries_written`` those whose checksum entries are in the sidecar. After a
commit one owned chunk is kept for reuse, so a decode loop that commits every few tokens
allocates nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sessionstore.kvfile.durability import Durability
from sessionstore.kvfile.header import Dims, Header
from sessionstore.kvfile.layout import record_dtype
from sessionstore.kvfile.sidecar import SidecarWriter

BIG_BATCH_FRACTION = 8  # a batch of >= capacity / 8 records is staged as its own chunk
WRITEBACK_MIN_BYTES = 4096  # early writes this big start their write-back (smaller ones wait)


@dataclass
class _Chunk:
    """``records[:used]`` are staged, in position order."""

    records: np.ndarray  # [capacity] structured records
    used: int

    @property
    def free(self) -> int:
        return int(self.records.shape[0]) - self.used


class Staging:
    """Records ``[nrec, nrec + count)`` of a writer, not yet committed."""

    def __init__(self, dtype: np.dtype, capacity: int) -> None:
        self.dtype = dtype  # the file version's packed record dtype
        self.capacity = max(1, int(capacity))  # records per owned chunk
        self.written = 0  # leading staged records already written to the file (not fsynced)
        self.entries_written = 0  # leading staged records whose sidecar entries are written
        self._chunks: list[_Chunk] = []
        self._spare: _Chunk | None = None

    @classmethod
    def for_file(cls, header: Header, dims: Dims, staging_bytes: int) -> Staging:
        """An empty staging buffer of about ``staging_bytes`` for the records of ``header``'s file."""
        return cls(record_dtype(header.version, dims, header.tag), staging_bytes // header.record_bytes)

    @property
    def count(self) -> int:
        return sum(chunk.used for chunk in self._chunks)

    def add(self, packed: np.ndarray) -> None:
        """Stage ``packed`` [k] records after the staged ones."""
        done, k = 0, int(packed.shape[0])
        while done < k:
            tail = self._chunks[-1] if self._chunks else None
            if tail is None or tail.free == 0:
                if (k - done) * BIG_BATCH_FRACTION >= self.capacity:  # its own chunk: no copy
                    self._chunks.append(_Chunk(packed[done:], k - done))
                    return
                tail = self._take_spare()
                self._chunks.append(tail)
            n = min(tail.free, k - done)
            tail.records[tail.used:tail.used + n] = packed[done:done + n]
            tail.used += n
            done += n

    def _take_spare(self) -> _Chunk:
        spare, self._spare = self._spare, None
        if spare is not None and spare.records.shape[0] == self.capacity:
            spare.used = 0
            return spare
        return _Chunk(np.empty(self.capacity, dtype=self.dtype), 0)  # [capacity] records

    def full_prefix(self) -> int:
        """Staged records in the leading full chunks (what is worth writing early)."""
        total = 0
        for chunk in self._chunks:
            if chunk.free:
                break
            total += chunk.used
        return total

    def byte_views(self, start: int, stop: int) -> list[np.ndarray]:
        """Byte views of staged records [start, stop) (0 = the first record past nrec)."""
        views: list[np.ndarray] = []
        first = 0
        for chunk in self._chunks:
            lo, hi = max(start, first), min(stop, first + chunk.used)
            if lo < hi:
                views.append(chunk.records[lo - first:hi - first].view(np.uint8))  # [n * rec] u8
            first += chunk.used
        return views

    def trim(self, keep: int) -> None:
        """Keep the first ``keep`` staged records."""
        kept: list[_Chunk] = []
        for chunk in self._chunks:
            if keep <= 0:
                break
            chunk.used = min(chunk.used, keep)
            keep -= chunk.used
            kept.append(chunk)
        self._chunks = kept
        self.written = min(self.written, self.count)
        self.entries_written = min(self.entries_written, self.count)

    def write_records(self, io: Durability, fd: int, first_offset: int, stop: int, *,
                      start_writeback: bool) -> int:
        """Write staged records [written, stop) to ``fd`` (record 0 of the staging at
        ``first_offset``), no fsync; with ``start_writeback`` a big enough write starts its
        write-back at once. Returns the byte offset just past what was written."""
        written = self.written
        rec = self.dtype.itemsize
        if stop <= written:
            return first_offset + written * rec
        offset = first_offset + written * rec
        size = (stop - written) * rec
        io.pwritev(fd, [v.data for v in self.byte_views(written, stop)], offset)
        if start_writeback and size >= WRITEBACK_MIN_BYTES:  # smaller: a page written per record
            io.start_writeback(fd, offset, size)
        self.written = stop
        return offset + size

    def write_entries(self, sidecar: SidecarWriter, first_position: int, stop: int) -> None:
        """Write the sidecar entries of staged records [entries_written, stop) (record 0 of the
        staging is at ``first_position``); the sidecar does not vouch for them yet."""
        start = self.entries_written
        if stop <= start:
            return
        position = first_position + start
        for view in self.byte_views(start, stop):
            position += sidecar.write_entries(position, view.data)
        self.entries_written = stop

    def committed(self) -> None:
        """Everything staged was committed: empty, keeping one owned chunk for reuse."""
        for chunk in self._chunks:
            if chunk.records.base is None:  # a buffer we allocated (not a caller's batch)
                self._spare = chunk
        self._chunks = []
        self.written = self.entries_written = 0


__all__ = ["Staging", "BIG_BATCH_FRACTION"]
