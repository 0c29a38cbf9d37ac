"""Convert a ``.coli_kv`` file between v1 (f32 rows), v2 (fp8 rows) and v3 (4-bit rows), never
in place (FORMAT.md 1.5).

The output is exactly what the engine would write: the committed records only, header nrec =
their count, tag 0 (v1) / 1 (v2) / the codec's (v3). Rows go through f32: v1 -> v2 is the
engine's row quantizer, v2 -> v1 ``table[code] * scale`` with inert rows as +0.0 rows, v3 rows
are encoded / decoded by their codec (``kernels.tq``); the same version and tag is a clean copy
of the committed records. Records stream in chunks (memory bounded by
``chunk_bytes`` times a small factor, whatever the file size), the output goes to a temp file
``<dst>.<owner>-<hex>.tmp`` in DST's directory -> fsync -> os.replace -> fsync dir, and DST gets
a fresh sidecar. The temps of killed runs beside DST are swept first (sweep.py).
"""
from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kernels.errors import ColiError, CorruptionError, FormatError, NotFoundError
from kernels.tq import TqCodec
from sessionstore.kvfile.fsio import fsync_parent, open_regular, write_all
from sessionstore.kvfile.header import Header, pack_header, validate_v3_widths
from sessionstore.kvfile.layout import record_dtype, sanitize_scales
from sessionstore.kvfile.reader import KVReader, open_kv
from sessionstore.kvfile.sidecar import (
    TEMP_SUFFIX,
    load_sidecar,
    record_checksums,
    remove_stale_temp,
    sidecar_path,
    write_sidecar_atomic,
)
from sessionstore.kvfile.sidecar_check import check_records
from sessionstore.kvfile.sweep import sweep_beside, temp_beside
from sessionstore.log import get_logger

CHUNK_BYTES = 64 << 20  # source + destination bytes per step
log = get_logger("convert")
Progress = Callable[[int, int], None]  # (records done, records total)


class DestinationExistsError(ColiError, FileExistsError):
    """DST exists and ``--force`` was not given."""


@dataclass(frozen=True)
class ConvertResult:
    src: str
    dst: str
    from_version: int
    to_version: int
    nrec: int
    to_kv_dtype: str
    bytes_written: int
    sidecar: str
    seconds: float


def parse_version(value: int | str) -> int:
    """``1``, ``2``, ``3``, ``"v1"``, ``"v2"`` or ``"v3"`` -> 1, 2 or 3."""
    text = str(value).lower().removeprefix("v")
    if text not in ("1", "2", "3"):
        raise FormatError(f"convert: target version {value!r}, expected v1, v2 or v3")
    return int(text)


def target_codec(version: int, bits: int | None = None, codec: str | None = None) -> TqCodec | None:
    """The v3 codec of ``--tq-bits B [--tq-codec int4|polar]`` (default: int4 at 4 bits, PolarQuant
    otherwise; int4 only with 4 bits); None for v1/v2, which take neither option."""
    if version != 3:
        if bits is not None or codec is not None:
            raise FormatError(f"convert: --tq-bits/--tq-codec apply to --to v3 only, not v{version}")
        return None
    bits = 4 if bits is None else bits
    kind = codec or ("int4" if bits == 4 else "polar")
    if kind not in ("int4", "polar"):
        raise FormatError(f"convert: --tq-codec {kind!r}, expected int4 or polar")
    if kind == "int4" and bits != 4:
        raise FormatError(f"convert: the int4 codec has 4 bits, found --tq-bits {bits} (use --tq-codec polar)")
    return TqCodec("int4", 4) if kind == "int4" else TqCodec("polar", bits)


def _check_destination(src: KVReader, dst: str, force: bool) -> None:
    """Refuse writing in place, over a non-regular file, or over an existing file unless forced."""
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise NotFoundError(f"{dst}: directory {parent} does not exist")
    if os.path.realpath(dst) == os.path.realpath(src.path):
        raise FormatError(f"{dst}: is the source file; convert never writes in place")
    try:
        st = os.lstat(dst)
    except FileNotFoundError:
        return
    src_st = os.stat(src.path)
    if stat.S_ISLNK(st.st_mode):
        raise FormatError(f"{dst}: is a symlink; refusing to replace it")
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{dst}: exists and is not a regular file")
    if (st.st_dev, st.st_ino) == (src_st.st_dev, src_st.st_ino):
        raise FormatError(f"{dst}: is the same file as {src.path} (same inode); never in place")
    if not force:
        raise DestinationExistsError(f"{dst}: exists; pass --force to replace it")


def _refuse_condemned(src: KVReader) -> None:
    """Never convert rows the source's sidecar condemns (what `verify` calls CORRUPTION): a
    damaged sidecar, or a vouched record that no longer matches its checksum."""
    sidecar = load_sidecar(src.path)  # a damaged sidecar raises CorruptionError
    if sidecar is None:
        return
    report = check_records(src, sidecar)
    if not report.sound:
        raise CorruptionError(f"refusing to convert {src.path}: " + "; ".join(report.messages))


class _ChunkConverter:
    """Converts record chunks between encodings through f32, reusing its buffers (no page faults
    per chunk): source rows decoded (v1 copied, v2 dequantised, v3 decoded by its codec), then
    encoded for the target (v1 stored, v2 the row quantizer, v3 its codec)."""

    def __init__(self, source: Header, target: Header, max_records: int) -> None:
        dims = source.dims
        self.source, self.target = source, target
        self.out = np.empty(max_records, dtype=record_dtype(target.version, dims, target.tag))  # [c] records
        shape = {"lc": (max_records, dims.n_layers, dims.kv_lora),
                 "rc": (max_records, dims.n_layers, dims.qk_rope)}
        self.f32 = {row: np.empty(s, np.float32) for row, s in shape.items()}  # [c, L, n] f32
        self.codes = {row: np.empty(s, np.uint8) for row, s in shape.items()}  # [c, L, n] u8
        self.scales = {row: np.empty(s[:2], np.float32) for row, s in shape.items()}  # [c, L] f32

    def convert(self, chunk: np.ndarray) -> np.ndarray:
        """Records [c] of the source's encoding -> records [c] of the target's (a reused buffer)."""
        c = chunk.shape[0]
        out = self.out[:c]  # [c] records
        out["token"] = chunk["token"]
        if "index" in (out.dtype.names or ()):
            out["index"] = chunk["index"]  # [c, NI, D] f32
        src, dst = chunk["layers"], out["layers"]  # [c, L] layer records
        for row, scale in (("lc", "lc_scale"), ("rc", "rc_scale")):
            f32 = self._decoded(src, row, scale, c)  # [c, L, n] f32
            self._encode(f32, dst, row, scale, c)
        return out

    def _decoded(self, src: np.ndarray, row: str, scale: str, c: int) -> np.ndarray:
        from kernels.fp8 import dequantize_rows_into

        f32 = self.f32[row][:c]  # [c, L, n] f32
        if self.source.version == 1:
            np.copyto(f32, src[row])
        elif self.source.version == 2:
            codes = self.codes[row][:c]  # [c, L, n] u8
            np.copyto(codes, src[row])
            dequantize_rows_into(codes, sanitize_scales(src[scale]), f32)  # inert -> +0.0
        else:
            codec = self.source.codec
            assert codec is not None  # a v3 header always names its codec
            np.copyto(f32, codec.decode_rows(np.ascontiguousarray(src[row]), np.asarray(src[scale])))
        return f32

    def _encode(self, f32: np.ndarray, dst: np.ndarray, row: str, scale: str, c: int) -> None:
        from kernels.fp8 import quantize_rows_into

        if self.target.version == 1:
            dst[row] = f32
        elif self.target.version == 2:
            codes, scales = self.codes[row][:c], self.scales[row][:c]  # [c, L, n] u8, [c, L] f32
            quantize_rows_into(f32, codes, scales)
            dst[row] = codes
            dst[scale] = scales
        else:
            codec = self.target.codec
            assert codec is not None  # a v3 header always names its codec
            codes_v3, radius = codec.encode_rows(f32)  # [c, L, rb] u8, [c, L] f32
            dst[row] = codes_v3
            dst[scale] = radius


def _create_temp(dst: str) -> tuple[int, str]:
    """A new ``<dst>.<owner>-<hex>.tmp`` for writing, after sweeping the temps of killed runs
    beside DST (and the ownerless ``<dst>.tmp`` of older versions, as those always replaced it)."""
    sweep_beside(dst, TEMP_SUFFIX)
    remove_stale_temp(dst)
    tmp = temp_beside(dst, TEMP_SUFFIX)
    return open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), tmp


def _install(tmp: str, dst: str, force: bool) -> None:
    """Put the fsynced temp file at DST atomically; without ``force`` never clobber a DST that
    appeared meanwhile (link(2) refuses an existing name). DST's old sidecar goes first."""
    old_sidecar = sidecar_path(dst)
    if os.path.lexists(old_sidecar):  # never leave DST beside a sidecar of its old bytes
        os.unlink(old_sidecar)
        fsync_parent(old_sidecar)
    if force:
        os.replace(tmp, dst)
    else:
        try:
            os.link(tmp, dst)
        except FileExistsError:
            raise DestinationExistsError(f"{dst}: appeared while converting; pass --force") from None
        except OSError:  # a file system without hard links: check, then rename
            if os.path.lexists(dst):
                raise DestinationExistsError(f"{dst}: appeared while converting") from None
            os.replace(tmp, dst)
        else:
            os.unlink(tmp)
    fsync_parent(dst)


def convert_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], to_version: int | str,
                 *, codec: TqCodec | None = None, force: bool = False, progress: Progress | None = None,
                 chunk_bytes: int = CHUNK_BYTES, check_source: bool = True) -> ConvertResult:
    """Write DST as ``to_version`` (v3: rows of ``codec``, default int4) from the committed
    records of SRC (see the module doc).

    A source whose sidecar condemns a record is refused (FORMAT.md 4.4). ``check_source=False``:
    the caller has checked it already (the CLI runs the whole of `verify` first), or salvages it
    on purpose (`convert --unverified`: DST's fresh sidecar then vouches for the damaged records)."""
    target = parse_version(to_version)
    if target == 3:
        codec = codec or TqCodec("int4", 4)
    elif codec is not None:
        raise FormatError(f"convert: a v3 codec given for --to v{target}")
    dst = os.fspath(dst)
    started = time.perf_counter()
    with open_kv(src) as reader:
        _check_destination(reader, dst, force)
        if check_source:
            _refuse_condemned(reader)
        n, dims = reader.nrec, reader.dims
        header = Header(target, dims, n, codec.tag if codec is not None else None)
        if codec is not None:
            validate_v3_widths(dims, codec, reader.path)
        out_dtype = record_dtype(target, dims, header.tag)
        same = (target, header.tag) == (reader.version, reader.header.tag)
        step = max(1, chunk_bytes // (reader.record_bytes + out_dtype.itemsize))
        entries = np.empty(n, dtype="<u8")  # [nrec] u64 sidecar entries
        converter = None if same else _ChunkConverter(reader.header, header, min(step, max(n, 1)))
        rec = out_dtype.itemsize
        fd, tmp = _create_temp(dst)
        written = 0
        try:
            os.fchmod(fd, os.stat(reader.path).st_mode & 0o666)
            written += write_all(fd, pack_header(header))
            for start in range(0, n, step):
                stop = min(start + step, n)
                if same:
                    data = reader.records_bytes_view(start, stop)
                else:
                    assert converter is not None
                    out = converter.convert(reader.records[start:stop])
                    data = out.view(np.uint8).data  # [c * rec] u8
                written += write_all(fd, data)
                entries[start:stop] = record_checksums(data, rec, start)  # [c] u64, the GIL released
                del data
                reader.release_pages(start, stop)
                if progress is not None:
                    progress(stop, n)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        from_version = reader.version
        src_path = reader.path
    try:
        _install(tmp, dst, force)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    side = write_sidecar_atomic(dst, header, entries)
    seconds = time.perf_counter() - started
    log.info("kv.convert", src=src_path, dst=dst, from_version=from_version, to_version=target,
             nrec=n, bytes=written, seconds=round(seconds, 3))
    return ConvertResult(src_path, dst, from_version, target, n, header.kv_dtype, written, side, seconds)


__all__ = ["CHUNK_BYTES", "ConvertResult", "DestinationExistsError", "convert_file",
           "parse_version", "target_codec"]
