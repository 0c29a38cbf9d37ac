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
The writer checks, packs and logs; the state the protocol changes together (descriptor, counts,
staging, sidecar) and its steps are its :class:`~sessionstore.kvfile.appender.Appender`.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from kernels.errors import ColiError, LimitError
from kernels.rows import RecordRows
from sessionstore.kvfile import upgrade as _upgrade
from sessionstore.kvfile.appender import Appender
from sessionstore.kvfile.durability import Durability, SharedDurability
from sessionstore.kvfile.header import MAX_NREC, Dims, Header, complete_records, validate_dims
from sessionstore.kvfile.integrity import Vouched, VouchedMapping
from sessionstore.kvfile.layout import check_tokens, pack_records
from sessionstore.kvfile.lock import WriterLock
from sessionstore.kvfile.opening import OpenedFile, open_locked, refuse_non_regular
from sessionstore.kvfile.reader import KVReader, open_kv
from sessionstore.kvfile.writer_options import WriterOptions
from sessionstore.log import get_logger

log = get_logger("writer")


class KVWriter:
    """Single writer of one ``.coli_kv`` file. Create with :meth:`KVWriter.open`.

    It holds the lock, the vouching and its :class:`Appender` (the descriptor, the committed count,
    the staging buffer and the sidecar, changed together by the protocol's steps: FORMAT.md 3);
    here are the checks, the protocol's public face and the life cycle."""

    def __init__(self, *, path: str, dims: Dims, options: WriterOptions, io: Durability, lock: WriterLock,
                 opened: OpenedFile, nrec: int) -> None:
        self.path = path
        self.dims = dims
        self.kv_dtype = options.kv_dtype
        self._io = io
        self._lock = lock
        self._file = Appender(path=path, dims=dims, options=options, io=io, opened=opened, nrec=nrec)
        self._closed = False
        self.vouching = VouchedMapping()  # what open(vouch=...) checked before any repair, and how; its
        # ``pending``: the pass open(vouch_beside=True) started on a thread, whose result the caller takes

    # -- opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], dims: Dims, *, kv_dtype: str = "fp8",
             create: bool = True, staging_bytes: int = 8 << 20, durability: Durability | None = None,
             checksums: bool = True,
             upgrade_chunk_bytes: int = _upgrade.DEFAULT_CHUNK_BYTES,
             preallocate: int | None = 0, write_behind: bool = False,
             vouch: int | None = None, vouch_beside: bool = False) -> KVWriter:
        """Open (or create) ``path`` for appending; takes the writer lock at once (FORMAT.md 3.2).

        ``kv_dtype``: the rows the file holds ("f32", "fp8", "int4", "polar2".."polar6"); a v1
        file opened with another is rewritten as v2/v3 at the first append or :meth:`upgrade`.
        ``vouch``: before anything is repaired, upgraded or appended, every committed record the
        sidecar vouches for is checked and it must vouch for at least ``vouch`` of them
        (:func:`~sessionstore.kvfile.integrity.require_vouched`, FORMAT.md 4.4); what it found is
        ``writer.vouched``. ``vouch_beside``: that check's pass runs on a thread of its own when
        nothing would be repaired (:func:`~sessionstore.kvfile.integrity.start_vouching`):
        ``writer.vouched`` is then provisional, its ``pending`` the pass, whose result the caller
        MUST take before it uses anything computed from the rows, writes or appends; closing the
        writer waits for the pass. ``preallocate``: bytes of zero-filled headroom kept past the committed
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
            writer = _open_locked(cls, path, dims, options, create=create, io=io, lock=lock, vouch=vouch,
                                  beside=vouch_beside)
        except BaseException:
            lock.release()
            raise
        return writer

    # -- state ----------------------------------------------------------------------------
    @property
    def nrec(self) -> int:
        """Committed records (what a reader or a crash would see)."""
        return self._file.nrec

    @property
    def length(self) -> int:
        """Appended records, committed or not."""
        return self._file.length

    @property
    def version(self) -> int:
        return self._file.header.version

    @property
    def record_bytes(self) -> int:
        return self._file.header.record_bytes

    @property
    def header(self) -> Header:
        return self._file.header.with_nrec(self._file.nrec)

    @property
    def pending_upgrade(self) -> bool:
        """A v1 file opened with fp8 or the 4-bit tier on, not yet rewritten as v2 / v3."""
        return self.kv_dtype != "f32" and self._file.header.version == 1

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ColiError(f"{self.path}: writer is closed")

    @property
    def vouched(self) -> Vouched | None:
        """What ``open(vouch=...)`` found (None without ``vouch``)."""
        return self.vouching.vouched

    def take_vouched_reader(self) -> KVReader | None:
        """The reader ``open(vouch=...)`` checked the records through, handed to the caller when
        it still describes the file (:meth:`VouchedMapping.take`); None otherwise."""
        return self.vouching.take(self._file.nrec, self.version)

    # -- append -----------------------------------------------------------------------------
    def append(self, rows: RecordRows) -> int:
        """Stage ``rows`` (k positions, all layers) after the appended ones; returns the length.

        Shapes, token ids (in [0, vocab)) and the indexer rows are checked before anything is
        staged. The first append to a v1 file opened with fp8 on upgrades it to v2 first. Full
        chunks of staged records (with ``write_behind``, every one) are written at once, no fsync.
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
        self._file.stage(pack_records(self.version, self.dims, rows, self._file.header.tag))  # [k] records
        return self.length

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
        return self._file.commit(beside)

    # -- truncate ---------------------------------------------------------------------------
    def truncate(self, n: int) -> int:
        """Keep the first ``n`` records (clamped to the appended length); returns the new length.

        Below what the disk may count as committed, this is durable at once: the sidecar count,
        fsync, then nrec, fsync. Above it, only staged records are dropped.
        """
        self._check_open()
        n = max(0, min(int(n), self.length))
        if self.pending_upgrade and n < self._file.nrec:
            self._file.upgrade_to(self.kv_dtype, keep=n)
            return n
        self._file.truncate(n)
        return self.length

    # -- upgrade ----------------------------------------------------------------------------
    def upgrade(self) -> bool:
        """Rewrite a v1 file opened with fp8 / the 4-bit tier on as v2 / v3 now (crash-safe);
        False if nothing to do."""
        self._check_open()
        if not self.pending_upgrade:
            return False
        self._file.upgrade_to(self.kv_dtype, keep=self._file.nrec)
        return True

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
            self.vouching.drop()
            self._file.close()
            self._io.release()
            self._lock.release()
            log.info("kv.close", path=self.path, nrec=self._file.nrec,
                     dropped=self.length - self._file.nrec)

    def __enter__(self) -> KVWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(commit=exc_type is None)

    def __repr__(self) -> str:
        return (f"KVWriter({self.path!r}, v{self.version}, nrec={self._file.nrec}, "
                f"length={self.length}, closed={self._closed})")


def _open_locked(cls: type[KVWriter], path: str, dims: Dims, options: WriterOptions, *, create: bool,
                 io: Durability, lock: WriterLock, vouch: int | None, beside: bool = False) -> KVWriter:
    """The writer of ``path``, its lock held: the file opened (or created), checked against its
    sidecar when ``vouch`` asks, then its commit word and sidecar recovered (FORMAT.md 3.5)."""
    opened = open_locked(path, dims, options.kv_dtype, create=create, io=io)
    header = opened.header
    writer: KVWriter | None = None
    try:
        complete = complete_records(header, opened.size)
        writer = cls(path=path, dims=dims, options=options, io=io, lock=lock, opened=opened, nrec=complete)
        if vouch is not None:  # under the lock, before any repair touches the files
            # every record hashed; beside, the pages are mapped by the tokens' gather (KVReader.token_copy)
            writer.vouching.check(open_kv(path, expect=dims, populate=not beside), vouch, beside=beside)
        if not writer.pending_upgrade:
            writer._file.recover(header.nrec)
    except BaseException:
        os.close(opened.fd)
        if writer is not None:
            writer.vouching.drop()
        raise
    log.info("kv.open", path=path, version=header.version, nrec=writer.nrec, kv_dtype=options.kv_dtype,
             created=opened.created, pending_upgrade=writer.pending_upgrade, mode="write")
    return writer


__all__ = ["KVWriter"]
