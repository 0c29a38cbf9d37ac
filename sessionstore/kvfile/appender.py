"""The state a :class:`~sessionstore.kvfile.writer.KVWriter` changes together, and the steps that
change it (FORMAT.md 3.3-3.7): :class:`Appender`.

It holds the one read-write descriptor, the header, the committed count and the most the commit
word on disk may hold, the staging buffer, the sidecar and the file's known end, and keeps the
invariant "nrec on disk never past what was written and synced" alone: the writer checks and
packs what it is given, then hands the records here to be staged, committed, cut back or rewritten
as v2 / v3. Writes are the staging's (``staging.py``), the barriers the durability's, the zero-filled
headroom ``headroom.py``'s and the v1 rewrite ``upgrade.py``'s.
"""
from __future__ import annotations

import os
import stat
from collections.abc import Callable

import numpy as np

from sessionstore.kvfile import upgrade as _upgrade
from sessionstore.kvfile.durability import Durability, wait_all
from sessionstore.kvfile.header import HEADER_SIZE, NREC_OFFSET, Dims, pack_nrec
from sessionstore.kvfile.headroom import Headroom
from sessionstore.kvfile.opening import OpenedFile, target_header
from sessionstore.kvfile.sidecar import HEADROOM_ENTRIES, SidecarWriter
from sessionstore.kvfile.sidecar_repair import catch_up, drop_untended, open_beside, repair_on_open
from sessionstore.kvfile.staging import Staging
from sessionstore.kvfile.writer_options import WriterOptions
from sessionstore.log import get_logger

log = get_logger("writer")


class Appender:
    """The open file of one writer: records staged after the committed ones, made durable by
    :meth:`commit`, cut back by :meth:`truncate`, rewritten by :meth:`upgrade_to`."""

    def __init__(self, *, path: str, dims: Dims, options: WriterOptions, io: Durability, opened: OpenedFile,
                 nrec: int) -> None:
        self.path = path
        self.dims = dims
        self.io = io
        self.options = options
        self.fd = opened.fd
        self.header = opened.header
        self.nrec = nrec  # committed (durable) count
        self.disk_nrec_max = opened.header.nrec  # the most the commit word on disk may hold
        self.staging = Staging.for_file(self.header, dims, options.staging_bytes)  # [nrec, length)
        self.sidecar: SidecarWriter | None = None
        self.dir_sync_due = False
        self.file_end = opened.size  # the file's size as far as this writer knows (never shrinks)
        self.headroom = Headroom(options.preallocate)  # zero-filled headroom past the committed records

    @property
    def length(self) -> int:
        """Appended records, committed or not."""
        return self.nrec + self.staging.count

    def recover(self, header_nrec: int) -> None:
        """Bring the commit word and the sidecar in line with the complete committed records."""
        if self.nrec < header_nrec:
            log.warning("kv.recovery", path=self.path, action="nrec beyond the file: cut back",
                        nrec=header_nrec, complete=self.nrec)
            self.write_nrec(self.nrec)
        if not self.options.checksums:
            drop_untended(self.path, self.io)
            return
        self.sidecar = repair_on_open(self.path, self.io, self.fd, self.header, self.nrec,
                                      headroom=self.headroom.enabled)

    # -- append -----------------------------------------------------------------------------
    def stage(self, packed: np.ndarray) -> None:
        """Stage ``packed`` ([k] records of this file's layout) after the appended ones, then write
        what is due (no fsync): records of full chunks, or with write-behind every staged record.
        The disk starts early; a failure is only logged (commit rewrites)."""
        self.staging.add(packed)
        stop = self.staging.count if self.options.write_behind else self.staging.full_prefix()
        try:
            self._write_staged(stop, start_writeback=True)
            if self.options.write_behind:
                self._write_sidecar_entries(stop)
        except OSError as exc:
            self.staging.written = self.staging.entries_written = 0
            log.warning("kv.write_deferred", path=self.path, error=str(exc))

    def _write_staged(self, stop: int, *, start_writeback: bool) -> None:
        """Write staged records [written, stop) at their offsets (no fsync)."""
        first = HEADER_SIZE + self.nrec * self.header.record_bytes
        end = self.staging.write_records(self.io, self.fd, first, stop, start_writeback=start_writeback)
        self.file_end = max(self.file_end, end)

    def _write_sidecar_entries(self, stop: int) -> None:
        """The sidecar entries of staged records [entries_written, stop), not yet vouched for."""
        if self.sidecar is not None:
            self.staging.write_entries(self.sidecar, self.nrec, stop)

    # -- commit -----------------------------------------------------------------------------
    def commit(self, beside: Callable[[], object] | None) -> int:
        """Make every appended record durable; returns the committed count (see KVWriter.commit)."""
        length = self.length
        if length == self.nrec and not self.dir_sync_due:
            if beside is not None:
                beside()
            return self.nrec
        try:
            if self.dir_sync_due:
                self.io.fsync_dir(self.path)
                self.dir_sync_due = False
            self._write_and_sync_records(beside)
            if length != self.nrec:
                self.write_nrec(length)
        except OSError as exc:
            if exc.filename is None:  # ENOSPC/EIO from a bare pwrite/fsync: say which file
                exc.filename = self.path
            self.staging.written = self.staging.entries_written = 0  # rewrite all from nrec
            log.warning("kv.commit_failed", path=self.path, nrec=self.nrec, length=length,
                        error=str(exc))
            raise
        added = length - self.nrec
        self.nrec = length
        self.staging.committed()
        record_bytes = self.header.record_bytes
        log.info("kv.commit", path=self.path, nrec=length, records=added, bytes=added * record_bytes)
        if added:
            self.file_end = self.headroom.refill(
                self.io, self.fd, self.path, committed_end=HEADER_SIZE + self.nrec * record_bytes,
                file_end=self.file_end, added=added, record_bytes=record_bytes)
        return length

    def _write_and_sync_records(self, beside: Callable[[], object] | None) -> None:
        """Steps 1-2: the sidecar's entries + count staged and their fdatasync started on a
        helper thread, the records written from nrec up, ``beside()`` started on another, the
        data fdatasync here; returns once all are done (then raises the first error)."""
        waits: list[Callable[[], object]] = []
        try:
            if self.sidecar is not None:
                catch_up(self.sidecar, self.fd, self.path, self.nrec, self.header.record_bytes)
                self._write_sidecar_entries(self.staging.count)  # those not written ahead
                self.sidecar.publish(self.length)
                waits.append(self.io.fsync_begin(self.sidecar.fileno()))
            self._write_staged(self.length - self.nrec, start_writeback=False)
            if beside is not None:  # started last: its Python work must not delay the above
                waits.append(self.io.begin(beside))
            self.io.fsync(self.fd)
        except BaseException:
            wait_all(waits, quiet=True)
            raise
        wait_all(waits)

    def write_nrec(self, nrec: int) -> None:
        """Commit word then fsync. ``disk_nrec_max`` covers a word that landed before a failure."""
        self.disk_nrec_max = max(self.disk_nrec_max, nrec)
        self.io.pwrite(self.fd, pack_nrec(nrec), NREC_OFFSET)
        self.io.fsync(self.fd)
        self.disk_nrec_max = nrec

    # -- truncate and upgrade ---------------------------------------------------------------
    def truncate(self, n: int) -> None:
        """Keep the first ``n`` (<= length) records: below what the disk may count as committed,
        durably at once (the sidecar count, fsync, then nrec, fsync); above it, only staged ones go."""
        keep_pending = max(n - self.nrec, 0)
        if n < self.disk_nrec_max:
            durable = min(n, self.nrec)
            if self.sidecar is not None:
                if self.sidecar.count > durable:
                    self.sidecar.set_count(durable)
                self.io.fsync(self.sidecar.fileno())
            self.write_nrec(durable)
            dropped = self.nrec - durable
            self.nrec = durable
            log.info("kv.truncate", path=self.path, nrec=durable, dropped_committed=dropped)
        self.staging.trim(keep_pending)

    def upgrade_to(self, kv_dtype: str, keep: int) -> None:
        """Rewrite the file's first ``keep`` records as the version ``kv_dtype`` needs (crash-safe,
        ``upgrade.py``) and go on in the copy; staged records are dropped."""
        mode = stat.S_IMODE(os.fstat(self.fd).st_mode)
        result = _upgrade.write_upgraded_copy(self.fd, self.path, self.header,
                                              target_header(kv_dtype, self.dims, keep), self.io,
                                              checksums=self.options.checksums,
                                              chunk_bytes=self.options.upgrade_chunk_bytes, file_mode=mode)
        old_fd, self.fd = self.fd, result.fd
        os.close(old_fd)
        self.file_end = int(os.fstat(self.fd).st_size)
        self.header = result.header
        self.nrec = self.disk_nrec_max = keep
        self.staging = Staging.for_file(self.header, self.dims, self.options.staging_bytes)
        self.sidecar = result.sidecar
        if self.sidecar is not None and self.headroom.enabled:
            self.sidecar.headroom_entries = HEADROOM_ENTRIES
        if result.error is not None:
            self.dir_sync_due = True  # the rename may not be durable yet: the next commit syncs
            if self.options.checksums and self.sidecar is None:
                self.sidecar = open_beside(self.path, self.header, headroom=self.headroom.enabled)
            raise result.error

    def close(self) -> None:
        """Close the sidecar and the descriptor (nothing is committed here)."""
        if self.sidecar is not None:
            self.sidecar.close()
        os.close(self.fd)


__all__ = ["Appender"]
