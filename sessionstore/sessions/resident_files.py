"""What a resident session holds open, opened and released together: the ``KVWriter`` (and with it
the single-writer lock), the reader's mapping of the committed rows, and the decoder cache built
over that mapping with zero copy (FORMAT.md 5.2).

Opening verifies every record the sidecar vouches for before anything is mapped (a request's resume:
while its turn's first step runs, ``check``, whose result the turn takes before anything leaves:
:func:`sessionstore.sessions.session_resume.await_check`); releasing closes
the descriptors and the lock at once and hands the cache, the staging buffers and the mapping to
the background thread (freeing and unmapping cost ~1 ms per GB of page tables).

A new session may be resident before its files exist (:meth:`ResidentFiles.start_empty`): its
decoder cache is an empty one and its writer is being made on an I/O thread (``making``); rows
wait in the cache until the writer is attached (:meth:`ResidentFiles.ready`), which the first
commit waits for. Until then nothing is committed, so a crash loses nothing committed.
"""
from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kernels.errors import ChecksumMismatchError, CorruptionError, FormatError
from kernels.model.protocols import Decoder, LatentCache
from sessionstore.kvfile import Dims, KVReader, KVWriter, PendingCheck, Vouched, open_kv, release_later
from sessionstore.log import get_logger
from sessionstore.sessions.manifest import Manifest

DECODE_PREALLOCATE = None  # the writer's decode-loop headroom (writer.default_headroom): token
# commits overwrite zero-filled blocks instead of growing the file (no metadata in the barrier)

log = get_logger("session")


class ResidentFiles:
    """The writer, the mapping and the cache of one session's ``.coli_kv`` file while resident."""

    def __init__(self, session_id: str, kv_path: Path) -> None:
        self.session_id = session_id
        self.kv_path = kv_path
        self.writer: KVWriter | None = None
        self.reader: KVReader | None = None
        self.cache: LatentCache | None = None
        self.making: Future[tuple[KVWriter, KVReader]] | None = None  # a new session's files, being made
        self.check: PendingCheck[Vouched] | None = None  # a resume's checksum pass, running beside its first
        # step (map(..., beside)): nothing computed from the rows leaves until settle_check() returned

    def start_empty(self, cache: LatentCache, making: Future[tuple[KVWriter, KVReader]]) -> None:
        """Hold ``cache`` (empty) while ``making`` makes the files and opens their writer and mapping."""
        self.cache, self.making = cache, making

    def ready(self) -> bool:
        """True once the writer is held: attached now if its making has ended (its error raised
        here, ``making`` cleared either way); False while it is still being made."""
        making = self.making
        if making is None:
            return True
        if not making.done():
            return False
        self.making = None
        self.writer, self.reader = making.result()
        return True

    @property
    def being_made(self) -> bool:
        """True while a new session's files are being made or not yet attached (:meth:`ready`):
        nothing of it is on disk to read or remove yet (no conversation file, no records)."""
        return self.making is not None

    @property
    def nrec(self) -> int:
        """The writer's committed records (0 while a new session's files are being made)."""
        return self.writer.nrec if self.writer is not None else 0

    def open_writer(self, manifest: Manifest, *, durability: Any, write_behind: bool,
                    beside: bool = False) -> KVWriter:
        """The writer, once every record the sidecar vouches for matched its checksum (the
        sidecar must vouch for all ``manifest.committed``); files untouched when refused. With
        ``beside`` the checksum pass may run on a thread instead (``KVWriter.open(vouch_beside=)``:
        :meth:`map` holds it as ``check``)."""
        try:
            return KVWriter.open(self.kv_path, Dims(**manifest.dims), kv_dtype=manifest.kv_dtype, create=False,
                                 durability=durability, preallocate=DECODE_PREALLOCATE,
                                 write_behind=write_behind, vouch=manifest.committed, vouch_beside=beside)
        except CorruptionError as exc:
            raise self._refused(exc) from None

    def _refused(self, exc: CorruptionError) -> CorruptionError:
        """The error of a resume refused by ``exc`` (the same whether the pass ran here or beside)."""
        log.info("session.resume_refused", id=self.session_id, path=str(self.kv_path), error=str(exc))
        message = f"session {self.session_id!r}: resume of {self.kv_path} refused: {exc}"
        if isinstance(exc, ChecksumMismatchError):  # how many records were refused travels with it
            return ChecksumMismatchError(message, exc.records)
        return CorruptionError(message)

    def settle_check(self) -> Vouched | None:
        """The result of the checksum pass running beside (waits for it; None without one): raises
        the error a serial check would have raised (:meth:`open_writer`'s); ``check`` cleared either way."""
        check, self.check = self.check, None
        if check is None:
            return None
        try:
            return check.result()
        except CorruptionError as exc:
            raise self._refused(exc) from None

    def map(self, writer: KVWriter, manifest: Manifest, model: Decoder[Any], backend: str) -> None:
        """Hold ``writer``, map its committed rows and build the decoder cache over them."""
        self.writer = writer
        if writer.version != manifest.kv_version:
            raise FormatError(f"{self.kv_path}: v{writer.version} file, the manifest says {manifest.kv_dtype}")
        reader = writer.take_vouched_reader()  # the mapping the checksums were checked through
        self.reader = reader = reader if reader is not None else open_kv(self.kv_path, expect=Dims(**manifest.dims))
        n = writer.nrec
        if reader.nrec != n:  # cannot happen: we hold the lock and the writer recovered the file
            raise CorruptionError(f"{self.kv_path}: reader sees {reader.nrec} records, writer {n}")
        self.check = writer.vouching.pending  # held even when it has already passed: its result is still taken
        # zero-copy rows, scales gathered in one pass; with the pass beside, a CPU cache reads them in place
        blocks = reader.layer_blocks(n, scales_in_place=self.check is not None and backend == "cpu")
        tokens = reader.token_copy()[:n]  # [n] i32, contiguous: the turn's prefix check and sampler read it next
        self.cache = model.cache_from_blocks(blocks, tokens, kv_dtype=manifest.kv_dtype, backend=backend,
                                             index_rows=reader.index_block(n))

    @property
    def live_writer(self) -> KVWriter:
        assert self.writer is not None, f"session {self.session_id!r} is not resident"  # callers ensure_resident
        return self.writer

    @property
    def live_cache(self) -> LatentCache:
        assert self.cache is not None, f"session {self.session_id!r} is not resident"  # callers ensure_resident
        return self.cache

    @property
    def live_reader(self) -> KVReader:
        assert self.reader is not None, f"session {self.session_id!r} is not resident"  # callers ensure_resident
        return self.reader

    def memory_bytes(self) -> int:
        """Mapped committed bytes + the cache's own rows (0 when nothing is open)."""
        mapped = self.reader.file_bytes if self.reader is not None else 0
        own = self.cache.own_nbytes if self.cache is not None else 0
        return int(mapped + own)

    def append_rows(self) -> None:
        """Hand the cache's rows past the writer's length to the writer (staged, not committed)."""
        writer, cache = self.live_writer, self.live_cache
        start = writer.length
        if cache.length > start:
            writer.append(cache.records_since(start))

    def release(self) -> None:
        """Close the writer's descriptors and lock now; the cache, the staging buffers and the
        mapping go to the background thread (nothing of ours reads them again)."""
        making, self.making = self.making, None
        self.check = None  # a pass still running beside: the writer's close below waits for it
        if making is not None:  # released before its files were attached: attach them to release them
            try:
                self.writer, self.reader = making.result()
            except Exception as exc:  # nothing made, nothing to release
                log.info("session.files_not_made", id=self.session_id, error=str(exc))
        reader, writer = self.reader, self.writer
        garbage: list[Any] = [self.cache, writer, reader]  # freed by the background thread
        self.cache = self.reader = self.writer = None
        if writer is not None:
            writer.close(commit=False)  # descriptors and the lock: released here, now
        # the mapping goes with the cache's views, unmapped there too
        release_later(garbage, before=None if reader is None else lambda: reader.close(defer_unmap=True))


__all__ = ["DECODE_PREALLOCATE", "ResidentFiles"]
