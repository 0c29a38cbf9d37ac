"""The durable append path of a ``.coli_kv`` file: :class:`KVWriter` (FORMAT.md 3).

One writer per file (``<path>.lock``, 3.1), ONE persistent read-write descriptor and a staging
buffer of megabytes: ``append`` packs records into it (in the file's encoding; other encodings
go through f32), full buffers are written early (no fsync), and with ``write_behind`` every
append is written at once, its sidecar entry too. ``commit`` is the engine's protocol plus our
sidecar (3.4): records from the committed count up, their sidecar entries and count; fsync both;
THEN nrec at offset 32; fsync. A failed write or fsync keeps the last committed nrec and the staged
records (3.5); ``truncate(n)`` rewrites only nrec, the sidecar count first (3.6); a v1 file opened
with fp8 or the 4-bit tier on is rewritten crash-safely at the first append (3.7, ``upgrade.py``).
With ``preallocate``, small commits keep zero-filled headroom past the committed records (3.4.1,
``headroom.py``). Writers share one pool of fsync helper threads (:class:`SharedDurability`).
"""
from __future__ import annotations

import os
import stat
from collections.abc import Callable

from kernels.errors import ColiError, LimitError
from kernels.rows import RecordRows
from sessionstore.kvfile import upgrade as _upgrade
from sessionstore.kvfile.durability import Durability, SharedDurability, wait_all
from sessionstore.kvfile.header import (
    HEADER_SIZE,
    MAX_NREC,
    NREC_OFFSET,
    Dims,
    Header,
    complete_records,
    pack_nrec,
    validate_dims,
)
from sessionstore.kvfile.headroom import Headroom
from sessionstore.kvfile.integrity import Vouched, VouchedMapping
from sessionstore.kvfile.layout import check_tokens, pack_records
from sessionstore.kvfile.lock import WriterLock
from sessionstore.kvfile.opening import OpenedFile, open_locked, refuse_non_regular, target_header
from sessionstore.kvfile.reader import KVReader, open_kv
from sessionstore.kvfile.sidecar import HEADROOM_ENTRIES, SidecarWriter
from sessionstore.kvfile.sidecar_repair import catch_up, drop_untended, open_beside, repair_on_open
from sessionstore.kvfile.staging import Staging
from sessionstore.kvfile.writer_options import WriterOptions
from sessionstore.log import get_logger

log = get_logger("writer")


class KVWriter:
    """Single writer of one ``.coli_kv`` file. Create with :meth:`KVWriter.open`.

    On the class-size list (tests/house): 8 are read-only properties and 3 the context manager and
    repr; the rest are the steps of one protocol (FORMAT.md 3: append, commit, truncate, upgrade, close)
    over state that must change together (the descriptor, the committed count and the most the
    commit word on disk may hold, the staging buffer, the sidecar): split, the invariant "nrec on
    disk never past what was written and synced" would be held by several objects at once. What
    stands apart lives beside it: opening, staging, headroom, durability, sidecar repair, upgrade."""

    def __init__(self, *, path: str, dims: Dims, options: WriterOptions, io: Durability, lock: WriterLock,
                 opened: OpenedFile, nrec: int) -> None:
        self.path = path
        self.dims = dims
        self.kv_dtype = options.kv_dtype
        self._io = io
        self._lock = lock
        self._fd = opened.fd
        self._header = opened.header
        self._nrec = nrec  # committed (durable) count
        self._disk_nrec_max = opened.header.nrec  # the most the commit word on disk may hold
        self._staging_bytes = options.staging_bytes
        self._checksums = options.checksums
        self._upgrade_chunk_bytes = options.upgrade_chunk_bytes
        self._staging = Staging.for_file(self._header, self.dims, self._staging_bytes)  # [nrec, length)
        self._write_behind = options.write_behind
        self._sidecar: SidecarWriter | None = None
        self._dir_sync_due = False
        self._closed = False
        self._file_end = opened.size  # the file's size as far as this writer knows (never shrinks)
        self._headroom = Headroom(options.preallocate)  # zero-filled headroom past the committed records
        self._vouch = VouchedMapping()  # what open(vouch=...) checked before any repair, and how

    # -- opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], dims: Dims, *, kv_dtype: str = "fp8",
             create: bool = True, staging_bytes: int = 8 << 20, durability: Durability | None = None,
             checksums: bool = True,
             upgrade_chunk_bytes: int = _upgrade.DEFAULT_CHUNK_BYTES,
             preallocate: int | None = 0, write_behind: bool = False,
             vouch: int | None = None) -> KVWriter:
        """Open (or create) ``path`` for appending; takes the writer lock at once (FORMAT.md 3.2).

        ``kv_dtype``: the rows the file holds ("f32", "fp8", "int4", "polar2".."polar6"); a v1
        file opened with another is rewritten as v2/v3 at the first append or :meth:`upgrade`.
        ``vouch``: before anything is repaired, upgraded or appended, every committed record the
        sidecar vouches for is checked and it must vouch for at least ``vouch`` of them
        (:func:`~sessionstore.kvfile.integrity.require_vouched`, FORMAT.md 4.4); what it found is
        ``writer.vouched``. ``preallocate``: bytes of zero-filled headroom kept past the committed
        records (0: exact files, as the engine writes them; None: :func:`default_headroom`).
        ``write_behind``: write every append past nrec at once (a decode loop's commit then only
        waits for the barrier).

        Raises LockedError (another writer), ModelMismatchError (other dims), FormatError (bad
        file, not a regular file, rows of another kv dtype), NotFoundError (absent, no create).
        """
        path = os.fspath(path)
        options = WriterOptions(kv_dtype=kv_dtype, staging_bytes=max(staging_bytes, 1), checksums=checksums,
                                upgrade_chunk_bytes=upgrade_chunk_bytes, preallocate=preallocate,
                                write_behind=write_behind)
        options.check(path)
        validate_dims(dims, path)
        refuse_non_regular(path)  # before the lock: no lock file beside a device or a FIFO
        io = durability if durability is not None else SharedDurability()
        lock = WriterLock(path).acquire()
        try:
            writer = cls._open_locked(path, dims, options, create=create, io=io, lock=lock, vouch=vouch)
        except BaseException:
            lock.release()
            raise
        return writer

    @classmethod
    def _open_locked(cls, path: str, dims: Dims, options: WriterOptions, *, create: bool, io: Durability,
                     lock: WriterLock, vouch: int | None) -> KVWriter:
        opened = open_locked(path, dims, options.kv_dtype, create=create, io=io)
        header = opened.header
        writer: KVWriter | None = None
        try:
            complete = complete_records(header, opened.size)
            writer = cls(path=path, dims=dims, options=options, io=io, lock=lock, opened=opened, nrec=complete)
            if vouch is not None:  # under the lock, before any repair touches the files
                writer._vouch.check(open_kv(path, expect=dims, populate=True), vouch)  # every record hashed
            if not writer.pending_upgrade:
                writer._recover(header.nrec)
        except BaseException:
            os.close(opened.fd)
            if writer is not None:
                writer._vouch.drop()
            raise
        log.info("kv.open", path=path, version=header.version, nrec=writer.nrec, kv_dtype=options.kv_dtype,
                 created=opened.created, pending_upgrade=writer.pending_upgrade, mode="write")
        return writer

    def _recover(self, header_nrec: int) -> None:
        """Bring the commit word and the sidecar in line with the complete committed records."""
        if self._nrec < header_nrec:
            log.warning("kv.recovery", path=self.path, action="nrec beyond the file: cut back",
                        nrec=header_nrec, complete=self._nrec)
            self._write_nrec(self._nrec)
        if not self._checksums:
            drop_untended(self.path, self._io)
            return
        self._sidecar = repair_on_open(self.path, self._io, self._fd, self._header, self._nrec,
                                       headroom=self._headroom.enabled)

    # -- state ------------------------------------------------------------------------------
    @property
    def nrec(self) -> int:
        """Committed records (what a reader or a crash would see)."""
        return self._nrec

    @property
    def length(self) -> int:
        """Appended records, committed or not."""
        return self._nrec + self._staging.count

    @property
    def version(self) -> int:
        return self._header.version

    @property
    def record_bytes(self) -> int:
        return self._header.record_bytes

    @property
    def header(self) -> Header:
        return self._header.with_nrec(self._nrec)

    @property
    def pending_upgrade(self) -> bool:
        """A v1 file opened with fp8 or the 4-bit tier on, not yet rewritten as v2 / v3."""
        return self.kv_dtype != "f32" and self._header.version == 1

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ColiError(f"{self.path}: writer is closed")

    @property
    def vouched(self) -> Vouched | None:
        """What ``open(vouch=...)`` found (None without ``vouch``)."""
        return self._vouch.vouched

    def take_vouched_reader(self) -> KVReader | None:
        """The reader ``open(vouch=...)`` checked the records through, handed to the caller when
        it still describes the file (:meth:`VouchedMapping.take`); None otherwise."""
        return self._vouch.take(self._nrec, self.version)

    # -- append -----------------------------------------------------------------------------
    def append(self, rows: RecordRows) -> int:
        """Stage ``rows`` (k positions, all layers) after the appended ones; returns the length.

        Shapes, token ids (in [0, vocab)) and the indexer rows are checked before anything is
        staged. The first append to a v1 file opened with fp8 on upgrades it to v2 first.
        """
        self._check_open()
        if self.pending_upgrade:
            self.upgrade()
        k = rows.length
        if k == 0:
            return self.length
        if self.length + k > MAX_NREC:
            raise LimitError(f"{self.path}: {self.length} + {k} records exceed the limit {MAX_NREC}")
        check_tokens(rows, self.dims.vocab, self.path)
        packed = pack_records(self.version, self.dims, rows, self._header.tag)  # [k] records
        self._staging.add(packed)
        self._flush_full_chunks()
        return self.length

    def _flush_full_chunks(self) -> None:
        """Write what is due (no fsync): records of full chunks, or with write-behind every
        staged record. The disk starts early; a failure is only logged (commit rewrites)."""
        stop = self._staging.count if self._write_behind else self._staging.full_prefix()
        try:
            self._write_staged(stop, start_writeback=True)
            if self._write_behind:
                self._write_sidecar_entries(stop)
        except OSError as exc:
            self._staging.written = self._staging.entries_written = 0
            log.warning("kv.write_deferred", path=self.path, error=str(exc))

    def _write_staged(self, stop: int, *, start_writeback: bool) -> None:
        """Write staged records [written, stop) at their offsets (no fsync)."""
        first = HEADER_SIZE + self._nrec * self.record_bytes
        end = self._staging.write_records(self._io, self._fd, first, stop, start_writeback=start_writeback)
        self._file_end = max(self._file_end, end)

    def _write_sidecar_entries(self, stop: int) -> None:
        """The sidecar entries of staged records [entries_written, stop), not yet vouched for."""
        if self._sidecar is not None:
            self._staging.write_entries(self._sidecar, self._nrec, stop)

    # -- commit -----------------------------------------------------------------------------
    def commit(self, *, beside: Callable[[], object] | None = None) -> int:
        """Make every appended record durable; returns the committed count.

        ``beside``: called once, on a helper thread while the data barrier is in flight (or
        here at once when there is nothing to commit), so CPU work overlaps the disk's; its
        error is raised after the barriers, before the commit word (nothing is committed).
        On an OSError nothing committed changes (nrec stays) and the staged records are kept:
        the next commit rewrites them all. The error is raised.
        """
        self._check_open()
        length = self.length
        if length == self._nrec and not self._dir_sync_due:
            if beside is not None:
                beside()
            return self._nrec
        try:
            if self._dir_sync_due:
                self._io.fsync_dir(self.path)
                self._dir_sync_due = False
            self._write_and_sync_records(beside)
            if length != self._nrec:
                self._write_nrec(length)
        except OSError as exc:
            if exc.filename is None:  # ENOSPC/EIO from a bare pwrite/fsync: say which file
                exc.filename = self.path
            self._staging.written = self._staging.entries_written = 0  # rewrite all from nrec
            log.warning("kv.commit_failed", path=self.path, nrec=self._nrec, length=length,
                        error=str(exc))
            raise
        added = length - self._nrec
        self._nrec = length
        self._staging.committed()
        log.info("kv.commit", path=self.path, nrec=length, records=added,
                 bytes=added * self.record_bytes)
        if added:
            self._file_end = self._headroom.refill(
                self._io, self._fd, self.path, committed_end=HEADER_SIZE + self._nrec * self.record_bytes,
                file_end=self._file_end, added=added, record_bytes=self.record_bytes)
        return length

    def _write_and_sync_records(self, beside: Callable[[], object] | None) -> None:
        """Steps 1-2: the sidecar's entries + count staged and their fdatasync started on a
        helper thread, the records written from nrec up, ``beside()`` started on another, the
        data fdatasync here; returns once all are done (then raises the first error)."""
        waits: list[Callable[[], object]] = []
        try:
            if self._sidecar is not None:
                catch_up(self._sidecar, self._fd, self.path, self._nrec, self.record_bytes)
                self._write_sidecar_entries(self._staging.count)  # those not written ahead
                self._sidecar.publish(self.length)
                waits.append(self._io.fsync_begin(self._sidecar.fileno()))
            self._write_staged(self.length - self._nrec, start_writeback=False)
            if beside is not None:  # started last: its Python work must not delay the above
                waits.append(self._io.begin(beside))
            self._io.fsync(self._fd)
        except BaseException:
            wait_all(waits, quiet=True)
            raise
        wait_all(waits)

    def _write_nrec(self, nrec: int) -> None:
        """Commit word then fsync. ``_disk_nrec_max`` covers a word that landed before a failure."""
        self._disk_nrec_max = max(self._disk_nrec_max, nrec)
        self._io.pwrite(self._fd, pack_nrec(nrec), NREC_OFFSET)
        self._io.fsync(self._fd)
        self._disk_nrec_max = nrec

    # -- truncate ---------------------------------------------------------------------------
    def truncate(self, n: int) -> int:
        """Keep the first ``n`` records (clamped to the appended length); returns the new length.

        Below what the disk may count as committed, this is durable at once: the sidecar count,
        fsync, then nrec, fsync. Above it, only staged records are dropped.
        """
        self._check_open()
        n = max(0, min(int(n), self.length))
        if self.pending_upgrade and n < self._nrec:
            self._do_upgrade(keep=n)
            return n
        keep_pending = max(n - self._nrec, 0)
        if n < self._disk_nrec_max:
            durable = min(n, self._nrec)
            if self._sidecar is not None:
                if self._sidecar.count > durable:
                    self._sidecar.set_count(durable)
                self._io.fsync(self._sidecar.fileno())
            self._write_nrec(durable)
            dropped = self._nrec - durable
            self._nrec = durable
            log.info("kv.truncate", path=self.path, nrec=durable, dropped_committed=dropped)
        self._staging.trim(keep_pending)
        return self.length

    # -- upgrade ----------------------------------------------------------------------------
    def upgrade(self) -> bool:
        """Rewrite a v1 file opened with fp8 / the 4-bit tier on as v2 / v3 now (crash-safe);
        False if nothing to do."""
        self._check_open()
        if not self.pending_upgrade:
            return False
        self._do_upgrade(keep=self._nrec)
        return True

    def _do_upgrade(self, keep: int) -> None:
        mode = stat.S_IMODE(os.fstat(self._fd).st_mode)
        result = _upgrade.write_upgraded_copy(self._fd, self.path, self._header,
                                              target_header(self.kv_dtype, self.dims, keep), self._io,
                                              checksums=self._checksums,
                                              chunk_bytes=self._upgrade_chunk_bytes, file_mode=mode)
        old_fd, self._fd = self._fd, result.fd
        os.close(old_fd)
        self._file_end = int(os.fstat(self._fd).st_size)
        self._header = result.header
        self._nrec = self._disk_nrec_max = keep
        self._staging = Staging.for_file(self._header, self.dims, self._staging_bytes)
        self._sidecar = result.sidecar
        if self._sidecar is not None and self._headroom.enabled:
            self._sidecar.headroom_entries = HEADROOM_ENTRIES
        if result.error is not None:
            self._dir_sync_due = True  # the rename may not be durable yet: the next commit syncs
            if self._checksums and self._sidecar is None:
                self._sidecar = open_beside(self.path, self._header, headroom=self._headroom.enabled)
            raise result.error

    # -- close ------------------------------------------------------------------------------
    def close(self, commit: bool = True) -> None:
        """Commit (unless ``commit=False``: staged records are dropped), then release everything."""
        if self._closed:
            return
        try:
            if commit:
                self.commit()
        finally:
            self._closed = True
            self._vouch.drop()
            if self._sidecar is not None:
                self._sidecar.close()
            os.close(self._fd)
            self._io.release()
            self._lock.release()
            log.info("kv.close", path=self.path, nrec=self._nrec,
                     dropped=self.length - self._nrec)

    def __enter__(self) -> KVWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(commit=exc_type is None)

    def __repr__(self) -> str:
        return (f"KVWriter({self.path!r}, v{self.version}, nrec={self._nrec}, "
                f"length={self.length}, closed={self._closed})")


__all__ = ["KVWriter"]
