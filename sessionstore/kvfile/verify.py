"""Check a ``.coli_kv`` file: structure, row contents, and the sidecar checksums where one exists.

``scan_records`` makes one chunked pass over the committed records (bounded memory: it keeps
8 bytes of scales per layer and record, 1/570 of a GLM-5.2 v2 file) and counts what the reading
rules mend: NaN codes (read as 0), inert rows (scale outside (0, 3.4e38): non-finite or <= 0, read as zero rows),
non-finite f32 values, tokens outside the vocabulary. ``verify_file`` adds the sidecar check.
A file is unsound only for corruption: a token outside [0, vocab) or a checksum mismatch on a
record the sidecar vouches for. Torn or stale tails, absent sidecars and records the sidecar does
not cover are reported, never called unsound (the engine's load rules accept them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels.errors import ColiError
from kernels.fp8 import usable_scales
from kernels.tq import usable_radius
from sessionstore.kvfile.integrity import bad_token_message
from sessionstore.kvfile.reader import KVReader, open_kv
from sessionstore.kvfile.sidecar import load_sidecar, sidecar_path
from sessionstore.kvfile.sidecar_check import SidecarReport, check_records
from sessionstore.log import get_logger

SCAN_CHUNK_BYTES = 32 << 20  # records examined per step (page-cache bytes, not heap)
log = get_logger("verify")


@dataclass
class LayerScan:
    """Per-layer counts (v2: codes and scales; v1: non-finite f32 values)."""

    lc_nan_codes: int = 0
    rc_nan_codes: int = 0
    lc_inert_rows: int = 0
    rc_inert_rows: int = 0
    nonfinite_values: int = 0


@dataclass
class RecordScan:
    nrec: int
    layers: list[LayerScan]
    tokens_out_of_range: int = 0
    first_bad_token: tuple[int, int] | None = None  # (position, token)
    index_nonfinite: int = 0
    lc_scales: np.ndarray | None = None  # [nrec, L] f32 stored scales (v2 only)
    rc_scales: np.ndarray | None = None  # [nrec, L] f32

    def total(self, name: str) -> int:
        return sum(getattr(layer, name) for layer in self.layers)


def _is_nan_code(codes: np.ndarray) -> np.ndarray:
    nan: np.ndarray = (codes & 0x7F) == 0x7F  # [...] bool
    return nan


def scan_records(reader: KVReader, *, keep_scales: bool = True,
                 chunk_bytes: int = SCAN_CHUNK_BYTES) -> RecordScan:
    """One chunked pass over the complete committed records of ``reader``."""
    dims, n = reader.dims, reader.nrec
    scan = RecordScan(nrec=n, layers=[LayerScan() for _ in range(dims.n_layers)])
    if reader.version in (2, 3) and keep_scales:
        scan.lc_scales = np.empty((n, dims.n_layers), np.float32)  # [nrec, L] f32
        scan.rc_scales = np.empty((n, dims.n_layers), np.float32)  # [nrec, L] f32
    step = max(1, chunk_bytes // reader.record_bytes)
    for start in range(0, n, step):
        stop = min(start + step, n)
        chunk = reader.records[start:stop]  # [c] records (mmap view)
        tokens = chunk["token"]  # [c] i32
        bad = np.flatnonzero((tokens < 0) | (tokens >= dims.vocab))  # [b] positions in chunk
        if bad.size:
            if scan.first_bad_token is None:
                scan.first_bad_token = (start + int(bad[0]), int(tokens[bad[0]]))
            scan.tokens_out_of_range += int(bad.size)
        layers = chunk["layers"]  # [c, L] layer records
        if reader.version in (2, 3):
            lc_scale, rc_scale = layers["lc_scale"], layers["rc_scale"]  # [c, L] f32 (v3: radii)
            if reader.version == 2:
                lc_nan = _is_nan_code(layers["lc"]).sum(axis=(0, 2))  # [L]
                rc_nan = _is_nan_code(layers["rc"]).sum(axis=(0, 2))  # [L]
                lc_inert = (~usable_scales(lc_scale)).sum(axis=0)  # [L]
                rc_inert = (~usable_scales(rc_scale)).sum(axis=0)  # [L]
            else:  # v3 has no NaN codes; a radius of 0 or one outside [0, 3.4e38) is an inert row
                lc_nan = rc_nan = np.zeros(dims.n_layers, np.int64)  # [L]
                lc_inert = (~(usable_radius(lc_scale) & (lc_scale != 0))).sum(axis=0)  # [L]
                rc_inert = (~(usable_radius(rc_scale) & (rc_scale != 0))).sum(axis=0)  # [L]
            for i, layer in enumerate(scan.layers):
                layer.lc_nan_codes += int(lc_nan[i])
                layer.rc_nan_codes += int(rc_nan[i])
                layer.lc_inert_rows += int(lc_inert[i])
                layer.rc_inert_rows += int(rc_inert[i])
            if scan.lc_scales is not None and scan.rc_scales is not None:
                scan.lc_scales[start:stop] = lc_scale
                scan.rc_scales[start:stop] = rc_scale
        else:
            bad_lc = (~np.isfinite(layers["lc"])).sum(axis=(0, 2))  # [L]
            bad_rc = (~np.isfinite(layers["rc"])).sum(axis=(0, 2))  # [L]
            for i, layer in enumerate(scan.layers):
                layer.nonfinite_values += int(bad_lc[i] + bad_rc[i])
        if dims.n_index_layers and dims.index_head_dim:
            scan.index_nonfinite += int((~np.isfinite(chunk["index"])).sum())
        del chunk, tokens, layers
        reader.release_pages(start, stop)
    return scan


@dataclass
class VerifyReport:
    path: str
    version: int
    dims: dict[str, int]
    header_nrec: int
    nrec: int
    record_bytes: int
    file_bytes: int
    stale_tail_bytes: int
    sound: bool = True
    problems: list[str] = field(default_factory=list)  # why the file is unsound
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    sidecar: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "sound": self.sound, "version": self.version, **self.dims,
                "header_nrec": self.header_nrec, "nrec": self.nrec,
                "record_bytes": self.record_bytes, "file_bytes": self.file_bytes,
                "stale_tail_bytes": self.stale_tail_bytes, "counts": self.counts,
                "sidecar": self.sidecar, "problems": self.problems, "warnings": self.warnings,
                "notes": self.notes}


def _sidecar_dict(report: SidecarReport) -> dict[str, Any]:
    return {"status": report.status, "vouched": report.vouched, "checked": report.checked,
            "mismatched": report.mismatched, "mismatched_positions": report.mismatched_positions,
            "not_covered": report.not_covered, "out_of_date_from": report.out_of_date_from}


def verify_file(path: str | os.PathLike[str], *, check_sidecar: bool = True) -> VerifyReport:
    """Verify one file. Bad input (unparseable header, not a regular file) raises a ColiError."""
    with open_kv(path) as reader:
        d = reader.dims
        report = VerifyReport(
            path=reader.path, version=reader.version,
            dims={"n_layers": d.n_layers, "kv_lora": d.kv_lora, "qk_rope": d.qk_rope,
                  "index_head_dim": d.index_head_dim, "n_index_layers": d.n_index_layers,
                  "vocab": d.vocab},
            header_nrec=reader.header.nrec, nrec=reader.nrec, record_bytes=reader.record_bytes,
            file_bytes=reader.file_bytes, stale_tail_bytes=reader.stale_tail_bytes)
        report.warnings.extend(reader.warnings)
        if reader.header.nrec == 0:
            report.notes.append("nrec = 0: nothing to resume")
        if reader.stale_tail_bytes:
            report.notes.append(
                f"{reader.stale_tail_bytes} bytes past the committed records (a stale or torn "
                "tail, normal after a crash or a truncate; ignored by readers)")
        scan = scan_records(reader, keep_scales=False)
        report.counts = {
            "lc_nan_codes": scan.total("lc_nan_codes"), "rc_nan_codes": scan.total("rc_nan_codes"),
            "lc_inert_rows": scan.total("lc_inert_rows"),
            "rc_inert_rows": scan.total("rc_inert_rows"),
            "nonfinite_values": scan.total("nonfinite_values"),
            "index_nonfinite": scan.index_nonfinite,
            "tokens_out_of_range": scan.tokens_out_of_range}
        _judge_scan(report, scan, reader)
        if check_sidecar:
            _check_sidecar(report, reader)
    log.info("kv.verify", path=report.path, sound=report.sound, nrec=report.nrec)
    return report


def _judge_scan(report: VerifyReport, scan: RecordScan, reader: KVReader) -> None:
    if scan.first_bad_token is not None:
        position, token = scan.first_bad_token
        report.sound = False
        report.problems.append(bad_token_message(scan.tokens_out_of_range, position, token, reader))
    counts = report.counts
    if counts["lc_nan_codes"] or counts["rc_nan_codes"]:
        report.warnings.append(
            f"{counts['lc_nan_codes']} Lc and {counts['rc_nan_codes']} Rc NaN codes (read as 0; "
            "the engine's encoder never writes them)")
    if counts["lc_inert_rows"] or counts["rc_inert_rows"]:
        report.warnings.append(
            f"{counts['lc_inert_rows']} Lc and {counts['rc_inert_rows']} Rc inert rows (scale "
            "non-finite or <= 0: read as zero rows)")
    if counts["nonfinite_values"] or counts["index_nonfinite"]:
        report.warnings.append(
            f"{counts['nonfinite_values']} non-finite latent values and "
            f"{counts['index_nonfinite']} non-finite indexer values")


def _check_sidecar(report: VerifyReport, reader: KVReader) -> None:
    try:
        sidecar = load_sidecar(reader.path)
    except ColiError as exc:
        report.sound = False
        report.problems.append(f"sidecar damaged: {exc}")
        report.sidecar = {"status": "damaged"}
        return
    if sidecar is None:
        report.notes.append(
            f"no sidecar ({sidecar_path(reader.path)}): checksums not checked (a file written by "
            "the engine has none)")
        report.sidecar = {"status": "absent"}
        return
    result = check_records(reader, sidecar)
    report.sidecar = _sidecar_dict(result)
    if not result.sound:
        report.sound = False
        report.problems.extend(result.messages)
    else:
        report.warnings.extend(result.messages)


__all__ = ["LayerScan", "RecordScan", "VerifyReport", "scan_records", "verify_file"]
