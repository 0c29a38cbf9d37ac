"""Checking a ``.coli_kv`` file's committed records against its sidecar (FORMAT.md 4.3).

``check_records`` tells corruption (a vouched record or the header's static fields no longer
match) from what is not: a sidecar out of date after another writer, records it does not cover.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from sessionstore.kvfile.header import HEADER_SIZE
from sessionstore.kvfile.sidecar import CHECK_CHUNK_RECORDS, Sidecar, hash_records, static_hash

if TYPE_CHECKING:
    from sessionstore.kvfile.reader import KVReader

MAX_REPORTED_POSITIONS = 64  # mismatch positions listed in a report (the count is always exact)


@dataclass
class SidecarReport:
    """What ``check_records`` found. ``sound`` is False only for corruption of vouched data."""

    status: str  # ok | corrupt | out_of_date | not_covered
    vouched: int = 0  # records the sidecar vouches for: min(count, nrec)
    checked: int = 0
    mismatched: int = 0
    mismatched_positions: list[int] = field(default_factory=list)
    not_covered: int = 0  # committed records past the sidecar's count
    out_of_date_from: int | None = None  # first position rewritten by another writer
    messages: list[str] = field(default_factory=list)
    sound: bool = True


def check_records(reader: KVReader, sidecar: Sidecar) -> SidecarReport:
    """Compare the sidecar with the file's header and its complete committed records.

    - static fields or record size differ: the file was rewritten as another version by another
      writer (out of date), or, same version, its header is corrupt;
    - a vouched record whose hash differs: CORRUPTION, unless the file's commit word no longer
      equals the sidecar's count (another writer truncated and rewrote) and the mismatches form
      one run up to the end of the vouched range: then the sidecar is out of date from there;
    - committed records past the count: not covered (written by another writer, such as the
      engine, or by a crash recovered before the sidecar caught up). Neither is corruption.
    """
    report = SidecarReport(status="ok")
    head = reader.header_bytes
    if sidecar.record_bytes != reader.record_bytes or sidecar.static_hash != static_hash(head):
        rewritten = sidecar.record_bytes != reader.record_bytes
        report.status = "out_of_date" if rewritten else "corrupt"
        report.sound = rewritten
        if rewritten:
            report.messages.append(
                f"sidecar out of date: it describes {sidecar.record_bytes}-byte records, the file "
                f"now holds v{reader.version} records of {reader.record_bytes} bytes (rewritten by "
                "another writer, such as the engine); no record is vouched for")
        else:
            report.messages.append(
                f"CORRUPTION: {reader.path}: header bytes [0:32]+[36:40] do not match the "
                "checksum in the sidecar (dims, vocab or tag changed)")
        report.not_covered = reader.nrec
        return report
    vouched = min(sidecar.count, reader.nrec, sidecar.available)
    report.vouched = vouched
    bad: list[int] = []
    mismatched = 0
    first_bad = -1
    for start in range(0, vouched, CHECK_CHUNK_RECORDS):
        stop = min(start + CHECK_CHUNK_RECORDS, vouched)
        found = hash_records(reader, start, stop)  # [stop - start] u64
        wrong = np.flatnonzero(found != sidecar.entries[start:stop]) + start  # [m] positions
        mismatched += int(wrong.size)
        if len(bad) < MAX_REPORTED_POSITIONS:
            bad.extend(int(p) for p in wrong[:MAX_REPORTED_POSITIONS - len(bad)])
        if wrong.size and first_bad < 0:
            first_bad = int(wrong[0])
        report.checked = stop
    if vouched < min(sidecar.count, reader.nrec):
        report.messages.append(
            f"sidecar {sidecar.path} is cut short: it holds {sidecar.available} of "
            f"{sidecar.count} entries")
    report.mismatched = mismatched
    report.mismatched_positions = bad
    report.not_covered = max(reader.nrec - vouched, 0)
    if mismatched:
        run_to_end = mismatched == vouched - first_bad
        another_writer = reader.header.nrec != sidecar.count
        if run_to_end and another_writer:
            report.status = "out_of_date"
            report.out_of_date_from = first_bad
            report.messages.append(
                f"sidecar out of date from record {first_bad}: records {first_bad}..{vouched - 1} "
                f"were rewritten by another writer (the commit word says {reader.header.nrec}, "
                f"the sidecar vouched for {sidecar.count}); they are not covered")
        else:
            report.status = "corrupt"
            report.sound = False
            rec = reader.record_bytes
            where = ", ".join(f"{p} (byte {HEADER_SIZE + p * rec})" for p in bad[:8])
            report.messages.append(
                f"CORRUPTION: {reader.path}: {mismatched} record(s) no longer match the checksums "
                f"the sidecar vouches for: {where}{' ...' if mismatched > 8 else ''}")
    if report.not_covered and report.status == "ok":
        report.status = "not_covered"
    if report.not_covered:
        report.messages.append(
            f"records {vouched}..{reader.nrec - 1} are not covered by the sidecar: written by "
            "another writer (such as the engine) or before a crash recovered; not checked")
    return report


__all__ = ["MAX_REPORTED_POSITIONS", "SidecarReport", "check_records"]
