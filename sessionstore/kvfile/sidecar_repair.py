"""Keeping a writer's sidecar true to its file (FORMAT.md 3.3 and 4.2): opened beside the kv file,
cut back or caught up to the committed count when a crash left them apart, or removed when the
writer runs without checksums (a sidecar nobody keeps up to date would lie)."""
from __future__ import annotations

import os

from kernels.errors import FormatError
from sessionstore.kvfile.durability import Durability
from sessionstore.kvfile.header import HEADER_SIZE, Header
from sessionstore.kvfile.sidecar import HEADROOM_ENTRIES, SidecarWriter, sidecar_path
from sessionstore.log import get_logger

CATCH_UP_BYTES = 32 << 20  # committed bytes re-read per step when the sidecar catches up

log = get_logger("writer")


def open_beside(path: str, header: Header, *, headroom: bool) -> SidecarWriter:
    """The sidecar of ``path`` for a writer (with zero-filled entry headroom when ``headroom``)."""
    return SidecarWriter(path, header.with_nrec(0), headroom_entries=HEADROOM_ENTRIES if headroom else 0)


def catch_up(sidecar: SidecarWriter, fd: int, path: str, nrec: int, record_bytes: int) -> None:
    """Stage entries for committed records [sidecar.count, nrec) the sidecar does not cover yet,
    reading them back from ``fd`` in bounded chunks."""
    step = max(1, CATCH_UP_BYTES // record_bytes)
    while sidecar.count < nrec:
        start = sidecar.count
        count = min(step, nrec - start)
        raw = os.pread(fd, count * record_bytes, HEADER_SIZE + start * record_bytes)
        if len(raw) != count * record_bytes:
            raise FormatError(f"{path}: byte {HEADER_SIZE + start * record_bytes}: short read of "
                              f"committed records ({len(raw)} of {count * record_bytes} bytes)")
        sidecar.stage(start, raw)


def repair_on_open(path: str, io: Durability, fd: int, header: Header, nrec: int, *,
                   headroom: bool) -> SidecarWriter:
    """Open the sidecar and bring its count to ``nrec``: cut back (a truncate or a crash left
    more), or caught up (records another writer appended); fsynced, logged as recovery."""
    sidecar = open_beside(path, header, headroom=headroom)
    count = sidecar.count
    if count != nrec:
        if count > nrec:
            sidecar.set_count(nrec)
        else:
            catch_up(sidecar, fd, path, nrec, header.record_bytes)
        io.fsync(sidecar.fileno())
        log.warning("kv.recovery", path=path, action="sidecar repaired", count_was=count, count=nrec)
    return sidecar


def drop_untended(path: str, io: Durability) -> None:
    """A writer without checksums cannot keep a sidecar true: remove it rather than let it lie."""
    side = sidecar_path(path)
    if os.path.lexists(side):
        io.unlink(side)
        io.fsync_dir(path)
        log.warning("kv.recovery", path=path, action="removed sidecar (checksums off)")


__all__ = ["CATCH_UP_BYTES", "catch_up", "drop_untended", "open_beside", "repair_on_open"]
