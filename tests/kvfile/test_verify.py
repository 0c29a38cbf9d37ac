"""verify: sound vs unsound, what is only reported (tails, absent sidecar), row counts."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from kernels.errors import FormatError
from sessionstore.kvfile.header import HEADER_SIZE, record_bytes
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import sidecar_path, write_sidecar_for
from sessionstore.kvfile.verify import scan_records, verify_file
from tests.kvfile.test_layout_fixtures import (
    ENGINE_DIMS,
    ENGINE_TOKENS,
    INDEXER_DIMS,
    f32_rows,
    fp8_rows,
    write_kv,
)

REC = record_bytes(2, INDEXER_DIMS)


def _with_sidecar(path: Path) -> Path:
    with open_kv(path) as kv:
        write_sidecar_for(kv)
    return path


def test_engine_file_without_sidecar_is_sound_with_a_note(tmp_path: Path) -> None:
    path = write_kv(tmp_path / "kv", 2, INDEXER_DIMS, fp8_rows(INDEXER_DIMS, ENGINE_TOKENS))
    report = verify_file(path)
    assert report.sound and report.problems == [] and report.warnings == []
    assert report.sidecar == {"status": "absent"}
    assert any("no sidecar" in n for n in report.notes)
    assert report.counts["lc_nan_codes"] == 0


def test_sound_file_with_sidecar(tmp_path: Path) -> None:
    path = _with_sidecar(write_kv(tmp_path / "kv", 1, INDEXER_DIMS, f32_rows(INDEXER_DIMS, ENGINE_TOKENS)))
    report = verify_file(path)
    assert report.sound and report.sidecar["status"] == "ok" and report.sidecar["vouched"] == 45


def test_flipped_bit_makes_the_file_unsound(tmp_path: Path) -> None:
    path = _with_sidecar(write_kv(tmp_path / "kv", 2, INDEXER_DIMS, fp8_rows(INDEXER_DIMS, ENGINE_TOKENS)))
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 9 * REC + 30] ^= 0x04
    path.write_bytes(bytes(data))
    report = verify_file(path)
    assert not report.sound
    assert report.sidecar["mismatched_positions"] == [9]
    assert "CORRUPTION" in report.problems[0]


def test_stale_and_torn_tails_are_reported_never_unsound(tmp_path: Path) -> None:
    rows = fp8_rows(INDEXER_DIMS, ENGINE_TOKENS)
    stale = _with_sidecar(write_kv(tmp_path / "stale", 2, INDEXER_DIMS, rows, nrec=40, tail=b"\0" * 9))
    report = verify_file(stale)
    assert report.sound and report.stale_tail_bytes == 5 * REC + 9
    assert any("stale or torn tail" in n for n in report.notes)
    torn = write_kv(tmp_path / "torn", 2, INDEXER_DIMS, rows)
    with open(torn, "r+b") as f:
        f.truncate(HEADER_SIZE + 44 * REC + 3)
    report = verify_file(torn)
    assert report.sound and report.nrec == 44 and report.header_nrec == 45
    assert any("cut inside" in w for w in report.warnings)


def test_engine_appended_records_are_not_covered_and_sound(tmp_path: Path) -> None:
    rows = fp8_rows(INDEXER_DIMS, ENGINE_TOKENS)
    path = _with_sidecar(write_kv(tmp_path / "kv", 2, INDEXER_DIMS, rows, nrec=30))
    with open(path, "r+b") as f:
        f.seek(32)
        f.write(struct.pack("<i", 45))
    report = verify_file(path)
    assert report.sound and report.sidecar["status"] == "not_covered"
    assert any("not covered by the sidecar" in w for w in report.warnings)


def test_nan_codes_and_inert_rows_are_counted(tmp_path: Path) -> None:
    rows = fp8_rows(ENGINE_DIMS, ENGINE_TOKENS)
    rows.lc_codes[0, 0, :2] = [0x7F, 0xFF]
    rows.rc_codes[1, 1, 0] = 0xFF
    rows.lc_scale[2, 1] = 0.0
    rows.rc_scale[3, 0] = np.inf
    rows.rc_scale[4, 0] = np.nan
    path = write_kv(tmp_path / "kv", 2, ENGINE_DIMS, rows)
    report = verify_file(path)
    assert report.sound
    assert report.counts["lc_nan_codes"] == 2 and report.counts["rc_nan_codes"] == 1
    assert report.counts["lc_inert_rows"] == 1 and report.counts["rc_inert_rows"] == 2
    with open_kv(path) as kv:
        scan = scan_records(kv, chunk_bytes=3 * kv.record_bytes)  # many chunks: same counts
        assert scan.layers[0].lc_nan_codes == 2 and scan.layers[1].rc_nan_codes == 1
        assert scan.layers[1].lc_inert_rows == 1 and scan.layers[0].rc_inert_rows == 2
        assert scan.lc_scales is not None and scan.lc_scales[2, 1] == 0.0


def test_token_outside_vocab_is_unsound(tmp_path: Path) -> None:
    tokens = ENGINE_TOKENS.copy()
    tokens[7] = 1000  # vocab is 1000
    path = write_kv(tmp_path / "kv", 1, ENGINE_DIMS, f32_rows(ENGINE_DIMS, tokens))
    report = verify_file(path)
    assert not report.sound
    assert "record 7" in report.problems[0] and ": 1000" in report.problems[0]


def test_nonfinite_f32_values_are_warnings(tmp_path: Path) -> None:
    rows = f32_rows(INDEXER_DIMS, ENGINE_TOKENS)
    rows.lc[3, 1, 2] = np.nan
    rows.index[4, 0, 0] = np.inf
    report = verify_file(write_kv(tmp_path / "kv", 1, INDEXER_DIMS, rows))
    assert report.sound and report.counts["nonfinite_values"] == 1 and report.counts["index_nonfinite"] == 1


def test_damaged_sidecar_is_unsound(tmp_path: Path) -> None:
    path = write_kv(tmp_path / "kv", 2, ENGINE_DIMS, fp8_rows(ENGINE_DIMS, ENGINE_TOKENS))
    Path(sidecar_path(path)).write_bytes(b"\0" * 100)
    report = verify_file(path)
    assert not report.sound and report.sidecar == {"status": "damaged"}


def test_bad_header_raises_our_error(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    path.write_bytes(b"COLIDV41" + b"\0" * 64)
    with pytest.raises(FormatError, match="COLIDV41"):
        verify_file(path)
