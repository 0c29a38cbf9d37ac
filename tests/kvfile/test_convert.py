"""convert: engine-exact output bytes, committed records only, never in place, bounded memory."""
from __future__ import annotations

import os
import struct
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kernels.errors import FormatError, NotFoundError
from kernels.rows import RecordRows
from sessionstore.kvfile.convert import DestinationExistsError, convert_file
from sessionstore.kvfile.header import HEADER_SIZE, Dims, record_bytes
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import load_sidecar, sidecar_path
from sessionstore.kvfile.sidecar_check import check_records
from tests.kvfile.test_layout_fixtures import (
    ENGINE_DIMS,
    ENGINE_TOKENS,
    INDEXER_DIMS,
    f32_rows,
    fp8_rows,
    struct_header,
    struct_record,
    write_kv,
)


def _oracle_decode(codes: np.ndarray) -> np.ndarray:
    """Independent decode: ml_dtypes' e4m3fn, NaN codes read as 0."""
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    values[(codes & 0x7F) == 0x7F] = 0.0
    return values


@pytest.mark.parametrize("dims", [ENGINE_DIMS, INDEXER_DIMS])
def test_v1_to_v2_is_what_the_engine_quantizer_writes(tmp_path: Path, dims: Dims) -> None:
    from kernels.fp8 import quantize_rows

    rows = f32_rows(dims, ENGINE_TOKENS, seed=1)
    src = write_kv(tmp_path / "src", 1, dims, rows, tail=b"\x01" * 17)  # stale tail dropped
    result = convert_file(src, tmp_path / "dst", "v2")
    lc_codes, lc_scale = quantize_rows(rows.lc)
    rc_codes, rc_scale = quantize_rows(rows.rc)
    want = RecordRows(tokens=rows.tokens, lc_codes=lc_codes, lc_scale=lc_scale, rc_codes=rc_codes,
                      rc_scale=rc_scale, index=rows.index)
    expected = struct_header(b"COLIKV2\0", dims, 45, 1) + b"".join(
        struct_record(2, want, p, dims) for p in range(45))
    assert (tmp_path / "dst").read_bytes() == expected
    assert (result.nrec, result.from_version, result.to_version) == (45, 1, 2)
    assert result.bytes_written == len(expected)


@pytest.mark.parametrize("dims", [ENGINE_DIMS, INDEXER_DIMS])
def test_v2_to_v1_is_table_times_scale(tmp_path: Path, dims: Dims) -> None:
    rows = fp8_rows(dims, ENGINE_TOKENS, seed=2)
    rows.lc_codes[5, 0, :3] = [0x7F, 0xFF, 0x80]  # NaN codes and -0.0
    rows.lc_scale[6, 1] = -1.0  # inert rows: +0.0 exactly
    rows.rc_scale[7, 0] = np.nan
    rows.lc_codes[6, 1, :] = 0xB8  # negative codes in an inert row must still give +0.0
    src = write_kv(tmp_path / "src", 2, dims, rows)
    convert_file(src, tmp_path / "dst", 1)
    def scale_ok(s: np.ndarray) -> np.ndarray:
        return np.where((s > 0) & (s < np.float32(3.4e38)), s, 0).astype(np.float32)

    lc = _oracle_decode(rows.lc_codes) * scale_ok(rows.lc_scale)[..., None]
    rc = _oracle_decode(rows.rc_codes) * scale_ok(rows.rc_scale)[..., None]
    lc[6, 1] = 0.0
    rc[7, 0] = 0.0
    want = RecordRows(tokens=rows.tokens, lc=lc, rc=rc, index=rows.index)
    expected = struct_header(b"COLIKV1\0", dims, 45, 0) + b"".join(
        struct_record(1, want, p, dims) for p in range(45))
    got = (tmp_path / "dst").read_bytes()
    assert got == expected
    with open_kv(tmp_path / "dst") as kv:
        assert np.signbit(kv.layer_rows(1).lc[6]).sum() == 0  # +0.0, not -0.0


def test_same_version_is_a_clean_copy_of_committed_records(tmp_path: Path) -> None:
    rows = fp8_rows(INDEXER_DIMS, ENGINE_TOKENS)
    src = write_kv(tmp_path / "src", 2, INDEXER_DIMS, rows, nrec=30, tail=b"junk")
    convert_file(src, tmp_path / "dst", "v2")
    data = src.read_bytes()
    rec = record_bytes(2, INDEXER_DIMS)
    assert (tmp_path / "dst").read_bytes() == data[:HEADER_SIZE] + data[HEADER_SIZE:HEADER_SIZE + 30 * rec]


def test_torn_source_converts_its_complete_records(tmp_path: Path) -> None:
    rows = f32_rows(ENGINE_DIMS, ENGINE_TOKENS)
    src = write_kv(tmp_path / "src", 1, ENGINE_DIMS, rows)
    with open(src, "r+b") as f:
        f.truncate(HEADER_SIZE + 20 * record_bytes(1, ENGINE_DIMS) + 9)
    result = convert_file(src, tmp_path / "dst", "v1")
    assert result.nrec == 20
    assert struct.unpack_from("<i", (tmp_path / "dst").read_bytes(), 32)[0] == 20


def test_round_trip_v2_v1_v2_is_byte_identical(tmp_path: Path) -> None:
    from kernels.fp8 import quantize_rows

    # codes produced by the quantizer survive v2 -> v1 -> v2 unchanged (amax code is 0x7E/0xFE)
    f32 = f32_rows(INDEXER_DIMS, ENGINE_TOKENS, seed=4)
    lc_codes, lc_scale = quantize_rows(f32.lc)
    rc_codes, rc_scale = quantize_rows(f32.rc)
    rows = RecordRows(tokens=f32.tokens, lc_codes=lc_codes, lc_scale=lc_scale, rc_codes=rc_codes,
                      rc_scale=rc_scale, index=f32.index)
    src = write_kv(tmp_path / "a", 2, INDEXER_DIMS, rows)
    convert_file(src, tmp_path / "b", "v1")
    convert_file(tmp_path / "b", tmp_path / "c", "v2")
    assert (tmp_path / "c").read_bytes() == src.read_bytes()


def test_destination_gets_a_verified_sidecar(tmp_path: Path) -> None:
    src = write_kv(tmp_path / "src", 1, INDEXER_DIMS, f32_rows(INDEXER_DIMS, ENGINE_TOKENS))
    result = convert_file(src, tmp_path / "dst", "v2")
    assert result.sidecar == sidecar_path(tmp_path / "dst")
    with open_kv(tmp_path / "dst") as kv:
        report = check_records(kv, load_sidecar(kv.path))
    assert report.status == "ok" and report.vouched == 45


def test_refuses_in_place_same_inode_and_existing(tmp_path: Path) -> None:
    src = write_kv(tmp_path / "src", 1, ENGINE_DIMS, f32_rows(ENGINE_DIMS, ENGINE_TOKENS))
    before = src.read_bytes()
    with pytest.raises(FormatError, match="never writes in place"):
        convert_file(src, src, "v2", force=True)
    with pytest.raises(FormatError, match="never writes in place"):
        convert_file(src, tmp_path / "." / "src", "v2", force=True)
    os.link(src, tmp_path / "hard")
    with pytest.raises(FormatError, match="same inode"):
        convert_file(src, tmp_path / "hard", "v2", force=True)
    (tmp_path / "dst").write_bytes(b"keep me")
    with pytest.raises(DestinationExistsError, match="--force"):
        convert_file(src, tmp_path / "dst", "v2")
    assert (tmp_path / "dst").read_bytes() == b"keep me"
    (tmp_path / "link").symlink_to(tmp_path / "dst")
    with pytest.raises(FormatError, match="symlink"):
        convert_file(src, tmp_path / "link", "v2", force=True)
    with pytest.raises(FormatError, match="not a regular file"):
        convert_file(src, tmp_path, "v2", force=True)
    with pytest.raises(NotFoundError):
        convert_file(src, tmp_path / "no" / "dst", "v2")
    with pytest.raises(FormatError, match="expected v1, v2 or v3"):
        convert_file(src, tmp_path / "x", "v4")
    assert src.read_bytes() == before


def test_force_replaces_existing_and_its_stale_sidecar(tmp_path: Path) -> None:
    src = write_kv(tmp_path / "src", 1, ENGINE_DIMS, f32_rows(ENGINE_DIMS, ENGINE_TOKENS))
    (tmp_path / "dst").write_bytes(b"old")
    Path(sidecar_path(tmp_path / "dst")).write_bytes(b"old sidecar")
    convert_file(src, tmp_path / "dst", "v2", force=True)
    with open_kv(tmp_path / "dst") as kv:
        assert kv.version == 2 and kv.nrec == 45
        assert check_records(kv, load_sidecar(kv.path)).status == "ok"


def test_failure_leaves_no_temp_and_no_destination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_kv(tmp_path / "src", 1, ENGINE_DIMS, f32_rows(ENGINE_DIMS, ENGINE_TOKENS))

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError):
        convert_file(src, tmp_path / "dst", "v2")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_chunked_streaming_matches_one_chunk_and_reports_progress(tmp_path: Path) -> None:
    src = write_kv(tmp_path / "src", 1, INDEXER_DIMS, f32_rows(INDEXER_DIMS, ENGINE_TOKENS))
    seen: list[tuple[int, int]] = []
    convert_file(src, tmp_path / "one", "v2")
    convert_file(src, tmp_path / "many", "v2", chunk_bytes=1000,
                 progress=lambda done, total: seen.append((done, total)))
    assert (tmp_path / "one").read_bytes() == (tmp_path / "many").read_bytes()
    assert len(seen) > 5 and seen[-1] == (45, 45)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_memory_is_bounded_by_the_chunk_not_the_file(tmp_path: Path) -> None:
    dims = Dims(4, 512, 64, 0, 0, 1000)
    k = 2000  # a 19 MB v1 file
    rng = np.random.default_rng(0)
    rows = RecordRows(tokens=np.zeros(k, np.int32),
                      lc=rng.standard_normal((k, 4, 512)).astype(np.float32),
                      rc=rng.standard_normal((k, 4, 64)).astype(np.float32))
    src = write_kv(tmp_path / "src", 1, dims, rows)
    del rows
    size = src.stat().st_size
    tracemalloc.start()
    try:
        convert_file(src, tmp_path / "dst", "v2", chunk_bytes=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size > 17 << 20
    assert peak < 8 << 20, peak  # ~1 MiB chunks: a few MiB of temporaries, not the file


def test_destination_appearing_midway_is_not_clobbered(tmp_path: Path) -> None:
    src = write_kv(tmp_path / "src", 1, ENGINE_DIMS, f32_rows(ENGINE_DIMS, ENGINE_TOKENS))
    dst = tmp_path / "dst"

    def someone_else_writes(done: int, total: int) -> None:
        if not dst.exists():
            dst.write_bytes(b"theirs")

    with pytest.raises(DestinationExistsError, match="appeared while converting"):
        convert_file(src, dst, "v2", chunk_bytes=2000, progress=someone_else_writes)
    assert dst.read_bytes() == b"theirs"
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]


def test_a_crashed_converts_temp_is_replaced_by_the_next_run(tmp_path: Path) -> None:
    src = write_kv(tmp_path / "src", 1, ENGINE_DIMS, f32_rows(ENGINE_DIMS, ENGINE_TOKENS))
    (tmp_path / "dst.tmp").write_bytes(b"left by a SIGKILL")
    convert_file(src, tmp_path / "dst", "v2")
    assert sorted(os.listdir(tmp_path)) == ["dst", "dst.colisum", "src"]
