"""The mmap reader: engine scenario round trips, zero-copy views, reading rules, refusals."""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from kernels.errors import FormatError, ModelMismatchError, NotFoundError
from kernels.rows import F32Rows, Fp8Rows
from sessionstore.kvfile.header import HEADER_SIZE, Dims, record_bytes
from sessionstore.kvfile.reader import open_kv
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
from tests.support.kv_raw import raw_scales


@pytest.mark.parametrize("dims", [ENGINE_DIMS, INDEXER_DIMS])
def test_v1_engine_scenario_round_trip(tmp_path: Path, dims: Dims) -> None:
    rows = f32_rows(dims, ENGINE_TOKENS)
    path = tmp_path / ".coli_kv"
    # the file is built with struct.pack, independently of the reader's dtype
    path.write_bytes(struct_header(b"COLIKV1\0", dims, 45, 0)
                     + b"".join(struct_record(1, rows, p, dims) for p in range(45)))
    with open_kv(path, expect=dims, fp8_enabled=False) as kv:
        assert (kv.version, kv.nrec, kv.dims) == (1, 45, dims)
        assert kv.tokens.tolist() == list(range(11, 56))
        assert kv.stale_tail_bytes == 0 and kv.warnings == []
        for l in range(dims.n_layers):
            layer = kv.layer_rows(l)
            assert isinstance(layer, F32Rows)
            np.testing.assert_array_equal(layer.lc, rows.lc[:, l])
            np.testing.assert_array_equal(layer.rc, rows.rc[:, l])
            part = kv.layer_rows(l, 10, 20)
            np.testing.assert_array_equal(part.lc, rows.lc[10:20, l])
        for i in range(dims.n_index_layers):
            np.testing.assert_array_equal(kv.index_rows(i), rows.index[:, i])


@pytest.mark.parametrize("dims", [ENGINE_DIMS, INDEXER_DIMS])
def test_v2_engine_scenario_round_trip_is_byte_identical(tmp_path: Path, dims: Dims) -> None:
    rows = fp8_rows(dims, ENGINE_TOKENS)
    path = write_kv(tmp_path / ".coli_kv", 2, dims, rows)
    with open_kv(path, expect=dims) as kv:
        layer = kv.layer_rows(1)
        assert isinstance(layer, Fp8Rows)
        np.testing.assert_array_equal(layer.lc_codes, rows.lc_codes[:, 1])
        np.testing.assert_array_equal(layer.rc_codes, rows.rc_codes[:, 1])
        np.testing.assert_array_equal(layer.lc_scale, rows.lc_scale[:, 1])
        np.testing.assert_array_equal(layer.rc_scale, rows.rc_scale[:, 1])
        for p in (0, 44):
            assert bytes(kv.records_bytes_view(p, p + 1)) == struct_record(2, rows, p, dims)
        assert bytes(kv.records_bytes_view(0, 45)) == path.read_bytes()[HEADER_SIZE:]


def test_views_are_zero_copy_and_read_only(tmp_path: Path) -> None:
    path = write_kv(tmp_path / "kv", 2, INDEXER_DIMS, fp8_rows(INDEXER_DIMS, ENGINE_TOKENS))
    with open_kv(path) as kv:
        layer = kv.layer_rows(0)
        rec = kv.record_bytes
        for view in (kv.tokens, layer.lc_codes, layer.rc_codes, kv.index_rows(1)):
            assert not view.flags.owndata and not view.flags.writeable
            assert view.strides[0] == rec  # a strided view into the mapping, not a copy
            assert np.shares_memory(view, kv.records)
        with pytest.raises(ValueError):
            kv.tokens[0] = 5


def test_v1_file_loaded_for_fp8_is_untouched(tmp_path: Path) -> None:
    path = write_kv(tmp_path / "kv", 1, ENGINE_DIMS, f32_rows(ENGINE_DIMS, ENGINE_TOKENS))
    before, mtime = path.read_bytes(), path.stat().st_mtime_ns
    with open_kv(path, fp8_enabled=True) as kv:
        assert kv.version == 1 and kv.nrec == 45
    assert path.read_bytes() == before and path.stat().st_mtime_ns == mtime


def test_v2_refused_when_fp8_disabled(tmp_path: Path) -> None:
    path = write_kv(tmp_path / "kv", 2, ENGINE_DIMS, fp8_rows(ENGINE_DIMS, ENGINE_TOKENS))
    with pytest.raises(FormatError, match="fp8 rows are disabled"):
        open_kv(path, fp8_enabled=False)


def test_dims_mismatch_is_model_mismatch(tmp_path: Path) -> None:
    path = write_kv(tmp_path / "kv", 2, ENGINE_DIMS, fp8_rows(ENGINE_DIMS, ENGINE_TOKENS))
    other = Dims(2, 8, 4, 0, 0, 999)
    with pytest.raises(ModelMismatchError, match="differ from the model"):
        open_kv(path, expect=other)


def test_inert_rows_and_nan_codes_follow_reading_rules(tmp_path: Path) -> None:
    rows = fp8_rows(ENGINE_DIMS, ENGINE_TOKENS)
    rows.lc_scale[3, 0] = 0.0
    rows.lc_scale[4, 0] = -2.0
    rows.rc_scale[5, 1] = np.nan
    rows.rc_scale[6, 1] = np.inf
    rows.lc_codes[7, 0, :] = 0x7F
    path = write_kv(tmp_path / "kv", 2, ENGINE_DIMS, rows)
    with open_kv(path) as kv:
        l0, l1 = kv.layer_rows(0), kv.layer_rows(1)
        assert l0.lc_scale[3] == 0.0 and l0.lc_scale[4] == 0.0
        assert l1.rc_scale[5] == 0.0 and l1.rc_scale[6] == 0.0
        assert l0.lc_scale[2] == rows.lc_scale[2, 0]
        assert l0.lc_codes[7].tolist() == [0x7F] * 8  # codes stay raw; the decode table zeroes them
        raw_lc, raw_rc = raw_scales(kv, 0)
        assert raw_lc[4] == -2.0  # the stored bytes are untouched
        from kernels.fp8 import DECODE_TABLE

        assert DECODE_TABLE[l0.lc_codes[7]].tolist() == [0.0] * 8


def test_torn_committed_records_yield_complete_prefix(tmp_path: Path) -> None:
    rows = fp8_rows(INDEXER_DIMS, ENGINE_TOKENS)
    path = write_kv(tmp_path / "kv", 2, INDEXER_DIMS, rows)
    rec = record_bytes(2, INDEXER_DIMS)
    with open(path, "r+b") as f:
        f.truncate(HEADER_SIZE + 30 * rec + rec // 2)  # cut inside record 30
    with open_kv(path) as kv:
        assert kv.header.nrec == 45 and kv.nrec == 30
        assert kv.tokens.tolist() == list(range(11, 41))
        assert kv.stale_tail_bytes == rec // 2
        assert any("cut inside the committed records" in w for w in kv.warnings)


def test_stale_tail_past_nrec_is_reported_not_read(tmp_path: Path) -> None:
    rows = f32_rows(ENGINE_DIMS, ENGINE_TOKENS)
    path = write_kv(tmp_path / "kv", 1, ENGINE_DIMS, rows, nrec=20, tail=b"\xff" * 13)
    with open_kv(path) as kv:
        assert kv.nrec == 20 and kv.warnings == []
        assert kv.stale_tail_bytes == 25 * record_bytes(1, ENGINE_DIMS) + 13
        assert kv.tokens.tolist() == list(range(11, 31))


def test_nrec_zero_reports_nothing(tmp_path: Path) -> None:
    path = write_kv(tmp_path / "kv", 2, ENGINE_DIMS, fp8_rows(ENGINE_DIMS, ENGINE_TOKENS[:0]))
    with open_kv(path) as kv:
        assert kv.nrec == 0 and kv.tokens.shape == (0,)
        assert kv.layer_rows(1).lc_codes.shape == (0, 8)
        assert bytes(kv.records_bytes_view(0, 0)) == b""


def test_empty_and_short_files_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(FormatError, match="empty file"):
        open_kv(empty)
    short = tmp_path / "short"
    short.write_bytes(struct_header(b"COLIKV2\0", ENGINE_DIMS, 0, 1)[:30])
    with pytest.raises(FormatError, match="short header: 30 bytes"):
        open_kv(short)


def test_symlink_fifo_directory_device_refused(tmp_path: Path) -> None:
    target = write_kv(tmp_path / "kv", 2, ENGINE_DIMS, fp8_rows(ENGINE_DIMS, ENGINE_TOKENS))
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(FormatError, match="is a symlink"):
        open_kv(link)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(FormatError, match="is a FIFO"):
        open_kv(fifo)  # never blocks: refused from lstat before any open
    with pytest.raises(FormatError, match="is a directory"):
        open_kv(tmp_path)
    with pytest.raises(FormatError, match="is a character device"):
        open_kv("/dev/null")


def test_missing_and_unreachable_paths_are_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        open_kv(tmp_path / "absent")
    a_file = write_kv(tmp_path / "kv", 2, ENGINE_DIMS, fp8_rows(ENGINE_DIMS, ENGINE_TOKENS))
    with pytest.raises(NotFoundError, match="no such file"):
        open_kv(a_file / "child")  # parent is a file: ENOTDIR (tests run as root: chmod is moot)


def test_huge_nrec_tiny_file_allocates_nothing_big(tmp_path: Path) -> None:
    import tracemalloc

    path = tmp_path / "kv"
    path.write_bytes(struct.pack("<8s8i", b"COLIKV1\0", 1000, 4000, 4000, 0, 0, 1000, 2**31 - 1, 0)
                     + b"\0" * 100)
    tracemalloc.start()
    try:
        with open_kv(path) as kv:
            assert kv.nrec == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_close_with_outstanding_views_is_safe(tmp_path: Path) -> None:
    path = write_kv(tmp_path / "kv", 2, ENGINE_DIMS, fp8_rows(ENGINE_DIMS, ENGINE_TOKENS))
    kv = open_kv(path)
    tokens = kv.tokens
    kv.close()
    assert tokens.tolist() == list(range(11, 56))  # the view keeps its mapping alive
    assert kv.records.shape == (0,)


def test_release_pages_keeps_data_readable(tmp_path: Path) -> None:
    rows = f32_rows(INDEXER_DIMS, np.arange(2000, dtype=np.int32) % 1000)
    path = write_kv(tmp_path / "kv", 1, INDEXER_DIMS, rows)
    with open_kv(path) as kv:
        before = kv.layer_rows(1).lc.sum()
        kv.release_pages(0, kv.nrec)
        kv.release_pages(5, 3)  # an empty range is a no-op
        np.testing.assert_array_equal(kv.layer_rows(1).lc, rows.lc[:, 1])
        assert kv.layer_rows(1).lc.sum() == before
