"""Read a ``.coli_kv`` file through mmap: zero-copy views of tokens, rows, scales, indexer rows.

Opening follows the engine's load rules (``layout.parse_header`` does the checking) plus ours:
the path must be a regular file (symlink, FIFO, device and directory are refused; lstat first,
open with O_NOFOLLOW|O_NONBLOCK, fstat after and compare). Only the complete committed records
are mapped: a file cut inside the committed part yields the records before the cut (a warning);
bytes past ``40 + nrec * record_bytes`` are a stale tail (normal, reported, never read).
"""
from __future__ import annotations

import os
import stat

import numpy as np

from kernels.errors import FormatError, ModelMismatchError, NotFoundError
from kernels.fp8 import usable_scales
from kernels.rows import F32Rows, Fp8Rows, TqRows
from kernels.tq import usable_radius
from sessionstore.kvfile.fsio import describe_mode, open_regular
from sessionstore.kvfile.header import HEADER_SIZE, Dims, Header, complete_records, parse_header
from sessionstore.kvfile.layout import record_dtype
from sessionstore.kvfile.mapping import FileMapping
from sessionstore.log import get_logger

log = get_logger("reader")

SCALE_GATHER_RECORDS = 256  # records per step of the one-pass scale gather (fits in L2 cache)
DEFER_UNMAP_BYTES = 64 << 20  # close(defer_unmap=True) hands mappings this big to the unmapper
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

def open_regular_file(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only if it is a regular file; returns (fd, fstat). Refuses the rest."""
    where = os.fspath(path)
    try:
        before = os.lstat(where)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise NotFoundError(f"{where}: no such file ({exc.strerror})") from None
    if not stat.S_ISREG(before.st_mode):
        raise FormatError(f"{where}: is {describe_mode(before.st_mode)}, expected a regular .coli_kv file")
    try:
        fd = open_regular(where, os.O_RDONLY | os.O_NONBLOCK, same_as=before)
    except FileNotFoundError:
        raise NotFoundError(f"{where}: no such file (removed while opening)") from None
    return fd, os.fstat(fd)


class KVReader:
    """A read-only, memory-mapped view of the complete committed records of one file.

    Read-only properties of the header, close and the context manager, and views of the one
    mapping, each a different slice of a record (a layer's rows, its scales, the indexer's keys,
    raw record bytes for a bundle); they share the mapping and the header it was checked against
    (FORMAT.md 2), which is the whole of the class."""

    def __init__(self, path: str | os.PathLike[str], *, expect: Dims | None = None,
                 fp8_enabled: bool = True, tq_tag: int | None = None, populate: bool = False) -> None:
        self.path = os.fspath(path)
        fd, st = open_regular_file(self.path)
        self._map: FileMapping | None = None
        try:
            self.identity = (int(st.st_dev), int(st.st_ino))  # the file mapped (a helper checks it is the same)
            self.file_bytes = int(st.st_size)
            if self.file_bytes == 0:
                raise FormatError(f"{self.path}: empty file (0 bytes): no .coli_kv header")
            self.header_bytes = os.pread(fd, HEADER_SIZE, 0)
            self.header: Header = parse_header(self.header_bytes, self.file_bytes, self.path)
            if expect is not None and expect != self.header.dims:
                raise ModelMismatchError(
                    f"{self.path}: file dims {self.header.dims.as_tuple()} (n_layers, kv_lora, "
                    f"qk_rope, index_head_dim, n_index_layers, vocab) differ from the model's "
                    f"{expect.as_tuple()}")
            if self.header.version == 2 and not fp8_enabled:
                raise FormatError(f"{self.path}: a v2 (fp8) file but fp8 rows are disabled here")
            if tq_tag is not None and self.version == 3 and self.header.tag != tq_tag:
                raise FormatError(
                    f"{self.path}: byte 36: a v3 {self.header.kv_dtype} file (tag {self.header.tag:#x}), "
                    f"expected tag {tq_tag:#x}: the 4-bit tier resumes only its own codec")
            self.nrec = complete_records(self.header, self.file_bytes)
            mapped = HEADER_SIZE + self.nrec * self.record_bytes
            self.stale_tail_bytes = self.file_bytes - mapped
            self.warnings: list[str] = list(self.header.notes)
            if self.nrec < self.header.nrec:
                self.warnings.append(
                    f"file cut inside the committed records: nrec says {self.header.nrec}, the "
                    f"file ({self.file_bytes} bytes) holds {self.nrec} complete records; using those")
                log.warning("kv.torn_committed", path=self.path, nrec=self.header.nrec,
                            complete=self.nrec)
            dtype = record_dtype(self.version, self.dims, self.header.tag)
            if self.nrec:
                self._map = FileMapping(fd, mapped, populate=populate)  # populate: every byte is read next
                self.records = np.frombuffer(self._map.buffer, dtype=dtype, count=self.nrec,
                                             offset=HEADER_SIZE)  # [nrec] records (read-only)
            else:
                self.records = np.zeros(0, dtype=dtype)  # [0] records
                self.records.flags.writeable = False
            self._scales: np.ndarray | None = None  # [2, L, nrec] f32, sanitised (v2, lazily)
            self._gather: np.ndarray | None = None  # [2, L, nrec] f32 stored scales, [0, scales_gathered) filled
            self._token_copy: np.ndarray | None = None  # [nrec] i32 contiguous (token_copy(), once)
            self.scales_gathered = 0  # leading records whose stored v2 scales are gathered already (by the
            # checksum pass, require_vouched(..., gather_scales=True)); the rest are gathered on first use
        finally:
            os.close(fd)
        log.info("kv.open", path=self.path, version=self.version, nrec=self.nrec,
                 stale_tail_bytes=self.stale_tail_bytes)

    # --- header facts ---------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.header.version

    @property
    def dims(self) -> Dims:
        return self.header.dims

    @property
    def record_bytes(self) -> int:
        return self.header.record_bytes

    @property
    def tokens(self) -> np.ndarray:
        return self.records["token"]  # [nrec] <i4 view

    # --- rows -----------------------------------------------------------------------------
    def token_copy(self) -> np.ndarray:
        """The records' input tokens as one contiguous array [nrec] i32, gathered once (each token
        is on another page of the mapping: every later use reads this copy). On a mapping opened
        without ``populate`` the gather's page faults map every record (the kernel maps the pages
        around a fault, 64 KiB, wider than a GLM-5.2 record): measured at 32k records, 67 ms
        against 92 ms for ``populate`` plus 1 ms for the gather (loaded host), and the records hash
        as fast afterwards as after ``populate``."""
        if self._token_copy is None or self._token_copy.shape[0] != self.nrec:
            self._token_copy = np.array(self.tokens, dtype="<i4")  # [nrec] i32
        return self._token_copy

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.dims.n_layers:
            raise IndexError(f"layer {layer} outside [0, {self.dims.n_layers})")

    def layer_rows(self, layer: int, start: int = 0, stop: int | None = None) -> F32Rows | Fp8Rows | TqRows:
        """Rows of one layer for positions [start, stop): views of the mapping (v2 scales, v3
        radii: views of the sanitised values gathered once per reader, :meth:`sanitized_scales`)."""
        self._check_layer(layer)
        part = self.records["layers"][start:stop, layer]  # [T] layer records (view)
        if self.version == 1:
            return F32Rows(lc=part["lc"], rc=part["rc"])  # [T, kv_lora] / [T, rope] f32 views
        scales = self.sanitized_scales()  # [2, L, nrec] f32 (cached)
        codec = self.header.codec
        if codec is not None:
            return TqRows(lc_codes=part["lc"], lc_radius=scales[0, layer, start:stop],  # [T, rbL] u8, [T] f32
                          rc_codes=part["rc"], rc_radius=scales[1, layer, start:stop],  # [T, rbR] u8, [T] f32
                          codec=codec, kv_lora=self.dims.kv_lora, qk_rope=self.dims.qk_rope)
        return Fp8Rows(lc_codes=part["lc"],  # [T, kv_lora] u8 view
                       lc_scale=scales[0, layer, start:stop],  # [T] f32 view (contiguous)
                       rc_codes=part["rc"],  # [T, rope] u8 view
                       rc_scale=scales[1, layer, start:stop])  # [T] f32 view (contiguous)

    def layer_blocks(self, stop: int | None = None, *,
                     scales_in_place: bool = False) -> list[list[F32Rows | Fp8Rows | TqRows]]:
        """One block per layer over records [0, stop) (default: all): what a decoder cache is
        built from (``DecoderCache.from_blocks``). Zero-copy rows; v2 scales from the one pass, or
        with ``scales_in_place`` (v2 only) views of the stored scales in the records ([T] f32, one
        record apart; nothing gathered, nothing sanitised): for a caller whose kernels apply the
        reading rule as they read each scale (every CPU attention kernel does: an unusable scale
        reads as 0.0, an inert row), so a resume's first step needs no pass over the scales."""
        if not scales_in_place or self.version != 2:
            return [[self.layer_rows(layer, 0, stop)] for layer in range(self.dims.n_layers)]
        part = self.records["layers"][:stop]  # [T, L] layer records (view)
        return [[Fp8Rows(lc_codes=part["lc"][:, layer], lc_scale=part["lc_scale"][:, layer],  # [T, kv_lora] u8, [T] f32
                         rc_codes=part["rc"][:, layer], rc_scale=part["rc_scale"][:, layer])]  # [T, rope] u8, [T] f32
                for layer in range(self.dims.n_layers)]

    def sanitized_scales(self) -> np.ndarray:
        """Every layer's Lc and Rc scales (v3: radii), sanitised by the reading rules (an unusable
        v2 scale: non-finite, <= 0 or >= 3.4e38; an unusable v3 radius: outside [0, 3.4e38); each
        marks an inert row and reads as 0.0): [2, L, nrec] f32, read-only, index 0 = Lc, 1 = Rc;
        each layer's row is contiguous.

        Gathered on first use in ONE sequential pass over the records (blocks of
        SCALE_GATHER_RECORDS records, both scales of every layer while the block is in cache;
        blocks a checksum pass already gathered, :meth:`gather_scales`, are kept), then cached:
        per-layer views are free. The scales lie 584 B apart inside a 45 KB GLM record, so a
        pass per layer would walk the whole mapping once per layer.
        """
        if self.version == 1:
            raise FormatError(f"{self.path}: v{self.version} rows carry no scales")
        if self._scales is None:
            n, step = self.nrec, SCALE_GATHER_RECORDS
            for b0 in range(self.scales_gathered, n, step):  # what gather_scales did not copy yet
                self.gather_scales(b0, min(b0 + step, n))
            out = self._gather if self._gather is not None else np.empty((2, self.dims.n_layers, 0), np.float32)
            self._gather = None
            usable = usable_radius(out) if self.version == 3 else usable_scales(out)  # [2, L, nrec] bool
            np.copyto(out, np.float32(0), where=~usable)  # inert rows read as 0.0
            out.flags.writeable = False
            self._scales = out
        return self._scales

    def gather_scales(self, start: int, stop: int) -> None:
        """Copy the stored scales (v3: radii) of records [start, stop) into the buffer that
        :meth:`sanitized_scales` sanitises, for a caller whose pass over these records has them in
        cache now (a resume's checksum pass); blocks come in order, the rest is copied there."""
        if self.version == 1 or self._scales is not None or start != self.scales_gathered or stop <= start:
            return
        if self._gather is None:
            self._gather = np.empty((2, self.dims.n_layers, self.nrec), dtype=np.float32)  # [2, L, nrec] f32
        stop = min(stop, self.nrec)
        src = self.records["layers"][start:stop]  # [b, L] layer records of one block
        np.copyto(self._gather[0, :, start:stop].T, src["lc_scale"])  # [b, L] f32
        np.copyto(self._gather[1, :, start:stop].T, src["rc_scale"])  # [b, L] f32
        self.scales_gathered = stop

    def index_rows(self, index_layer: int) -> np.ndarray:
        """Indexer rows of one indexer layer: [nrec, index_head_dim] f32 view."""
        if not 0 <= index_layer < self.dims.n_index_layers:
            raise IndexError(f"indexer layer {index_layer} outside [0, {self.dims.n_index_layers})")
        if self.dims.index_head_dim == 0:  # a header the engine loads: indexer layers of width 0
            return np.zeros((self.nrec, 0), dtype=np.float32)  # [nrec, 0] f32
        return self.records["index"][:, index_layer]

    def index_block(self, stop: int | None = None) -> np.ndarray | None:
        """Every indexer layer's rows of records [0, stop): [n, n_index_layers, index_head_dim] f32
        view (what a DSA decoder cache resumes from), or None when the file stores no indexer rows."""
        if not (self.dims.n_index_layers and self.dims.index_head_dim):
            return None
        return self.records["index"][:stop]  # [n, NI, hd] f32 view

    def records_bytes_view(self, start: int, stop: int) -> memoryview:
        """The exact bytes of records [start, stop) (zero-copy)."""
        if not 0 <= start <= stop <= self.nrec:
            raise IndexError(f"records [{start}, {stop}) outside [0, {self.nrec}]")
        if self._map is None:
            return memoryview(b"")
        rec = self.record_bytes
        return self._map.view(HEADER_SIZE + start * rec, HEADER_SIZE + stop * rec)

    def release_pages(self, start: int, stop: int) -> None:
        """Unmap the pages of records [start, stop) from this process (streaming passes call it
        so resident memory stays bounded); a later access maps them again from the page cache."""
        if self._map is None:
            return
        rec, page = self.record_bytes, PAGE_SIZE
        first = (HEADER_SIZE + start * rec) // page * page
        last = (HEADER_SIZE + stop * rec) // page * page  # the page holding `stop` stays mapped
        self._map.drop_pages(first, last - first)

    # --- lifetime -------------------------------------------------------------------------
    def close(self, *, defer_unmap: bool = False) -> None:
        """Drop the mapping; views still held by callers keep it alive until they go.

        ``defer_unmap``: a mapping of DEFER_UNMAP_BYTES or more is unmapped by a background
        thread once the last view is gone (the caller does not wait for the page-table
        teardown, ~1 ms per GB touched; nothing reads it again).
        """
        self.records = np.zeros(0, dtype=self.records.dtype)  # [0] records: drop our view
        self._scales = self._gather = self._token_copy = None
        mapping, self._map = self._map, None
        if mapping is not None:
            mapping.release(defer=defer_unmap and mapping.size >= DEFER_UNMAP_BYTES)

    def __enter__(self) -> KVReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_kv(path: str | os.PathLike[str], *, expect: Dims | None = None,
            fp8_enabled: bool = True, tq_tag: int | None = None, populate: bool = False) -> KVReader:
    """Open a ``.coli_kv`` file read-only (see :class:`KVReader`); ``tq_tag``: a v3 file must
    carry this codec tag (the 4-bit tier resumes only its own codec); ``populate``: the mapping's
    page tables filled at once (:class:`~.mapping.FileMapping`), for a caller that reads every record."""
    return KVReader(path, expect=expect, fp8_enabled=fp8_enabled, tq_tag=tq_tag, populate=populate)


__all__ = ["KVReader", "open_kv", "open_regular_file"]
