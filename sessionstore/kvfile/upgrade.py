"""Crash-safe rewrite of a v1 (f32) ``.coli_kv`` file as v2 (fp8) or v3 (4-bit), for a writer
with fp8 or the 4-bit tier on (FORMAT.md 3.7).

The engine upgrades by truncating the file in place, so a crash loses the conversation. Here the
v1 bytes stay untouched until a COMPLETE, fsynced new file replaces them with one atomic rename:

1. ``<path>.upgrade.tmp``: the new header (nrec = records kept) + every kept v1 record encoded
   (v2: the engine's row quantizer; v3: its codec), in bounded-memory chunks; its sidecar
   ``<tmp>.colisum`` beside it.
2. fsync both.
3. remove the old sidecar (it describes v1 bytes), fsync the directory.
4. ``os.replace(tmp, path)``, fsync the directory: THE switch point.
5. rename the new sidecar to ``<path>.colisum``, fsync the directory.

A crash before 4 leaves the whole v1 (and at most stale temp files, which the next writer open
removes); after 4 the whole new file. A missing or stale sidecar is repaired by the next writer open.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kernels.errors import CorruptionError
from kernels.rows import RecordRows
from sessionstore.kvfile.durability import Durability
from sessionstore.kvfile.fsio import open_regular
from sessionstore.kvfile.header import HEADER_SIZE, Header, pack_header
from sessionstore.kvfile.layout import pack_records, record_dtype
from sessionstore.kvfile.sidecar import SidecarWriter, sidecar_path
from sessionstore.log import get_logger

UPGRADE_SUFFIX = ".upgrade.tmp"
DEFAULT_CHUNK_BYTES = 32 << 20  # v1 bytes read (and quantized) per step

log = get_logger("upgrade")


def upgrade_temp_paths(path: str) -> tuple[str, str]:
    """The temp kv file and its temp sidecar used while upgrading ``path``."""
    tmp = path + UPGRADE_SUFFIX
    return tmp, sidecar_path(tmp)


@dataclass
class UpgradeResult:
    """The new file: an open read-write fd on it, its header, its sidecar writer (or None)."""

    fd: int
    header: Header
    sidecar: SidecarWriter | None
    error: OSError | None = None  # a step after the switch failed (dir fsync, sidecar rename)


def remove_stale_temps(path: str, io: Durability) -> list[str]:
    """Delete temp files a crashed upgrade left beside ``path``; returns what was removed."""
    removed = []
    tmp, tmp_side = upgrade_temp_paths(path)
    for temp in (tmp, tmp_side, tmp_side + ".tmp"):  # the last: the sidecar module's own temp
        if os.path.lexists(temp):
            io.unlink(temp)
            removed.append(temp)
    if removed:
        io.fsync_dir(path)
        log.warning("kv.recovery", path=path, action="removed stale upgrade temp files",
                    files=removed)
    return removed


def _v1_chunks(fd: int, path: str, header: Header, keep: int,
               chunk_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (start, records) for v1 records [0, keep) in chunks of at most ``chunk_bytes``."""
    rec = header.record_bytes
    dtype = record_dtype(1, header.dims)
    step = max(1, chunk_bytes // rec)
    for start in range(0, keep, step):
        count = min(step, keep - start)
        offset = HEADER_SIZE + start * rec
        raw = os.pread(fd, count * rec, offset)
        if len(raw) != count * rec:
            raise CorruptionError(
                f"{path}: byte {offset}: read {len(raw)} bytes of v1 records {start}..{start + count - 1}, "
                f"expected {count * rec} (the file shrank while upgrading)")
        yield start, np.frombuffer(raw, dtype=dtype)  # [count] v1 records


def write_upgraded_copy(fd_v1: int, path: str, header_v1: Header, target: Header, io: Durability, *,
                        checksums: bool, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                        file_mode: int = 0o644) -> UpgradeResult:
    """Steps 1-5 above, keeping ``target.nrec`` records in ``target``'s version and tag: returns
    the new file, open read-write. An error before the switch removes the temp files and raises
    (``path`` is still the untouched v1 file); an OSError after it is returned in ``error`` (the
    new file is in place; ``sidecar`` may then be None)."""
    tmp, tmp_side = upgrade_temp_paths(path)
    keep = target.nrec
    header_v2 = Header(target.version, header_v1.dims, keep, target.tag)
    rec2 = header_v2.record_bytes
    fd = open_regular(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, file_mode, opener=io.open)
    side: SidecarWriter | None = None
    try:
        io.pwrite(fd, pack_header(header_v2), 0)
        side = SidecarWriter(tmp, header_v2) if checksums else None
        for start, v1 in _v1_chunks(fd_v1, path, header_v1, keep, chunk_bytes):
            rows = RecordRows(tokens=v1["token"], lc=v1["layers"]["lc"], rc=v1["layers"]["rc"],
                              index=v1["index"] if header_v1.dims.n_index_layers else None)
            packed = pack_records(header_v2.version, header_v2.dims, rows,
                                  header_v2.tag).view(np.uint8)  # [count * rec2] u8
            io.pwrite(fd, packed.data, HEADER_SIZE + start * rec2)
            if side is not None:
                side.stage(start, packed.data)
        io.fsync_all([fd] + ([side.fileno()] if side is not None else []))
        old_side = sidecar_path(path)
        if os.path.lexists(old_side):
            io.unlink(old_side)
            io.fsync_dir(path)
        io.replace(tmp, path)  # THE switch point
    except BaseException:
        if side is not None:
            side.close()
        os.close(fd)
        _remove_quietly(io, tmp, tmp_side)
        raise
    result = UpgradeResult(fd, header_v2, None)
    try:  # past the switch: the v2 file is in place whatever fails now
        io.fsync_dir(path)
        if side is not None:
            side.close()
            io.replace(tmp_side, old_side)
            io.fsync_dir(path)
            result.sidecar = SidecarWriter(path, header_v2)  # reopened under its final name
    except OSError as exc:
        result.error = exc
        log.warning("kv.upgrade_tail_failed", path=path, error=str(exc))
    log.info("kv.upgrade", path=path, nrec=keep, from_version=1, to_version=header_v2.version,
             v1_bytes=HEADER_SIZE + keep * header_v1.record_bytes, v2_bytes=HEADER_SIZE + keep * rec2)
    return result


def _remove_quietly(io: Durability, *paths: str) -> None:
    for temp in paths:
        try:
            if os.path.lexists(temp):
                io.unlink(temp)
        except OSError:
            pass  # a stale temp is also removed at the next writer open


__all__ = ["write_upgraded_copy", "remove_stale_temps", "upgrade_temp_paths", "UpgradeResult",
           "UPGRADE_SUFFIX"]
