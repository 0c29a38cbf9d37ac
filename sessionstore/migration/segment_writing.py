"""What one ship uploads as a segment (FORMAT.md 6.7.3): where it starts, its bytes, its report.

A chain's records are immutable within a manifest epoch (FORMAT.md 5.6); a truncate (prefix reuse:
a regenerate, an edit, a re-tokenized boundary) bumps the epoch before it cuts the file. So a
ship that finds the epoch unchanged appends the records past the chain's end; one that finds it
moved ships a *cut*: the records from the first one that differs from the chain's. Which one that
is comes from the sidecar entries (FORMAT.md 4.1: ``xxh3_64`` of each record and its position,
the hash by which every reader vouches for a record): :func:`cut_point` compares the entries the
chain holds (the shipper keeps them, 8 bytes a record) with the local commit's, so finding the cut
reads no record and uploads only what changed, however many truncates came between two ships.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sessionstore.kvfile import SIDECAR_HEADER_SIZE, load_sidecar
from sessionstore.migration.exporting import ExportSource, kv_info
from sessionstore.migration.segment_format import SegmentRef, check_records, encode_segment
from sessionstore.sessions import SessionStore


@dataclass(frozen=True)
class ShipReport:
    """What one ship uploaded: the segment (or base bundle) and head bytes, and the records it carried."""

    session_id: str
    kind: str  # "segment" (an append), "cut" (a segment from below the chain's end),
    # "base" (a new chain, a rebase, a compaction) or "unchanged"
    start: int
    nrec: int
    object_bytes: int
    head_bytes: int
    record_bytes: int  # bytes of the records [start, nrec) themselves

    @property
    def shipped_bytes(self) -> int:
        return self.object_bytes + self.head_bytes


def cut_point(shipped: np.ndarray, entries: np.ndarray) -> int:
    """The first record at which ``entries`` (the local commit's sidecar entries, [committed] u64)
    differ from ``shipped`` (the chain's, [chain nrec] u64); the shorter length when one is a
    prefix of the other (a cut to a point the chain already ends past, then nothing new: start =
    committed; an append: start = the chain's end)."""
    n = min(len(shipped), len(entries))
    differ = np.flatnonzero(shipped[:n] != entries[:n])
    return int(differ[0]) if differ.size else n


def committed_entries(store: SessionStore, session_id: str, epoch: int, nrec: int) -> np.ndarray | None:
    """The sidecar entries of the local commit's first ``nrec`` records ([nrec] u64), when the
    session is still at manifest ``epoch`` and holds them all; None otherwise (unknown: the next
    truncate then ships a whole base, as a chain with no known records does)."""
    snap = store.snapshot(session_id)
    if snap.epoch != epoch or snap.committed < nrec:
        return None
    sidecar = load_sidecar(snap.kv_path)
    if sidecar is None or min(sidecar.count, sidecar.available) < nrec:
        return None
    entries: np.ndarray = sidecar.entries[:nrec]  # [nrec] u64 (a copy of the file's bytes)
    return entries if store.snapshot(session_id).epoch == epoch else None


def build_segment(source: ExportSource, session_id: str, generation: int, start: int,
                  prev: SegmentRef | None, *, cut: bool) -> tuple[bytes, dict[str, Any]]:
    """The segment object of records ``[start, committed)`` of ``source``'s commit (each checked
    against its sidecar entry first) and the parts it carries."""
    snap, rec, n = source.snap, source.snap.header.record_bytes, source.snap.committed
    assert source.entries is not None
    records = bytes(source.reader.records_bytes_view(start, n)) if n > start else b""
    parts: dict[str, Any] = {
        "kv_header": source.header_bytes, "records": records,
        "sidecar_header": (source.sidecar or b"")[:SIDECAR_HEADER_SIZE],
        "entries": source.entries[start:n].tobytes(), "manifest.json": source.manifest_json}
    if source.conversation is not None:
        parts["conversation.json"] = source.conversation
    if source.responses is not None:
        parts["responses.json"] = source.responses
    check_records(records, source.entries[start:n], start, rec, snap.kv_path)
    return encode_segment(session_id, generation, start, kv_info(snap), parts, prev, cut=cut), parts


__all__ = ["ShipReport", "build_segment", "committed_entries", "cut_point"]
