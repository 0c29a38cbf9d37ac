"""The reader's one-pass scale gather (``KVReader.sanitized_scales``), the per-layer blocks a
decoder cache is built from, and the mapping's lifetime (deferred unmap, read-only views)."""
from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from kernels.errors import FormatError
from kernels.rows import F32Rows, Fp8Rows
from sessionstore.kvfile import reader as reader_mod
from sessionstore.kvfile.layout import sanitize_scales
from sessionstore.kvfile.mapping import wait_for_unmaps
from sessionstore.kvfile.reader import open_kv
from tests.kvfile.test_layout_fixtures import (
    ENGINE_DIMS,
    ENGINE_TOKENS,
    INDEXER_DIMS,
    f32_rows,
    fp8_rows,
    write_kv,
)
from tests.support.kv_raw import raw_scales


def _damaged_scales_file(tmp_path: Path, n_records: int | None = None) -> tuple[Path, object]:
    rows = fp8_rows(INDEXER_DIMS, ENGINE_TOKENS)
    rows.lc_scale[3, 0] = 0.0  # inert rows: every unusable kind, spread over layers
    rows.lc_scale[4, 1] = -2.0
    rows.rc_scale[5, 0] = np.nan
    rows.rc_scale[6, 1] = np.inf
    rows.lc_scale[7, 1] = np.float32(3.4e38)
    rows.rc_scale[8, 0] = np.float32(1e-30)  # tiny but usable
    return write_kv(tmp_path / "kv", 2, INDEXER_DIMS, rows), rows


@pytest.mark.parametrize("step", [1, 3, 256])
def test_one_pass_equals_the_per_layer_reading_rule(tmp_path, monkeypatch, step):
    monkeypatch.setattr(reader_mod, "SCALE_GATHER_RECORDS", step)  # blocks cut anywhere
    path, rows = _damaged_scales_file(tmp_path)
    with open_kv(path) as kv:
        scales = kv.sanitized_scales()
        assert scales.shape == (2, INDEXER_DIMS.n_layers, kv.nrec) and scales.dtype == np.float32
        for layer in range(INDEXER_DIMS.n_layers):
            raw_lc, raw_rc = raw_scales(kv, layer)
            want_lc, want_rc = sanitize_scales(raw_lc), sanitize_scales(raw_rc)
            assert np.array_equal(scales[0, layer], want_lc) and np.array_equal(scales[1, layer], want_rc)
            assert scales[0, layer].flags.c_contiguous
            part = kv.layer_rows(layer, 10, 20)
            assert np.array_equal(part.lc_scale, want_lc[10:20])
            assert np.array_equal(part.rc_scale, want_rc[10:20])
            assert np.array_equal(part.lc_codes, rows.lc_codes[10:20, layer])
        assert scales[0, 0, 3] == 0 and scales[0, 1, 4] == 0 and scales[1, 0, 5] == 0
        assert scales[1, 1, 6] == 0 and scales[0, 1, 7] == 0
        assert scales[1, 0, 8] == np.float32(1e-30)
        assert raw_scales(kv, 1)[0][4] == -2.0  # the stored bytes are untouched


def test_gathered_once_read_only_and_shared_by_every_layer(tmp_path):
    path, _ = _damaged_scales_file(tmp_path)
    with open_kv(path) as kv:
        first = kv.sanitized_scales()
        assert kv.sanitized_scales() is first  # cached: per-layer views are free
        layers = [kv.layer_rows(layer) for layer in range(INDEXER_DIMS.n_layers)]
        for rows in layers:
            assert isinstance(rows, Fp8Rows)
            assert np.shares_memory(rows.lc_scale, first) and np.shares_memory(rows.rc_scale, first)
        with pytest.raises(ValueError):
            layers[0].lc_scale[0] = 1.0
        with pytest.raises(ValueError):
            first[0, 0, 0] = 1.0


def test_layer_blocks_are_views_of_the_records(tmp_path):
    path, rows = _damaged_scales_file(tmp_path)
    with open_kv(path) as kv:
        for n in (0, 1, 30, kv.nrec):
            blocks = kv.layer_blocks(n)
            assert len(blocks) == INDEXER_DIMS.n_layers and all(len(b) == 1 for b in blocks)
            for layer, (block,) in enumerate(blocks):
                assert block.length == n
                whole = kv.layer_rows(layer)
                for name in ("lc_codes", "lc_scale", "rc_codes", "rc_scale"):
                    assert np.array_equal(getattr(block, name), getattr(whole, name)[:n])
                assert np.array_equal(block.lc_codes, rows.lc_codes[:n, layer])
                assert not block.lc_codes.flags.owndata  # a view of the mapping


def test_v1_files_have_no_scales(tmp_path):
    path = write_kv(tmp_path / "kv", 1, ENGINE_DIMS, f32_rows(ENGINE_DIMS, ENGINE_TOKENS))
    with open_kv(path, fp8_enabled=False) as kv:
        with pytest.raises(FormatError, match="no scales"):
            kv.sanitized_scales()
        (block,) = kv.layer_blocks()[1]
        assert isinstance(block, F32Rows) and block.length == kv.nrec


def test_empty_file_has_empty_scales(tmp_path):
    path = write_kv(tmp_path / "kv", 2, ENGINE_DIMS, fp8_rows(ENGINE_DIMS, ENGINE_TOKENS), nrec=0)
    with open_kv(path) as kv:
        assert kv.sanitized_scales().shape == (2, ENGINE_DIMS.n_layers, 0)
        assert all(b[0].length == 0 for b in kv.layer_blocks())


@pytest.mark.parametrize("defer", [False, True])
def test_views_held_past_close_stay_valid(tmp_path, monkeypatch, defer):
    monkeypatch.setattr(reader_mod, "DEFER_UNMAP_BYTES", 0)  # even a small mapping is deferred
    path, rows = _damaged_scales_file(tmp_path)
    kv = open_kv(path)
    codes = kv.layer_rows(1).lc_codes  # a view of the mapping, kept by the caller
    tokens = kv.tokens
    raw = kv.records_bytes_view(0, 2)
    kv.close(defer_unmap=defer)
    wait_for_unmaps()
    assert np.array_equal(codes, rows.lc_codes[:, 1])  # still mapped: the views keep it
    assert tokens.tolist() == ENGINE_TOKENS.tolist() and len(bytes(raw)) == 2 * kv.record_bytes
    assert _mapped(path)
    del codes, tokens, raw
    gc.collect()
    wait_for_unmaps()  # the last view went: the unmap ran (in the background with ``defer``)
    assert not _mapped(path)


def _mapped(path: Path) -> bool:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps to look at")
    return str(path.resolve()) in maps.read_text()


def test_mapped_bytes_are_read_only(tmp_path):
    path, _ = _damaged_scales_file(tmp_path)
    with open_kv(path) as kv:
        view = kv.records_bytes_view(0, 1)
        assert view.readonly and view.format == "B"
        with pytest.raises(TypeError):
            view[0] = 1
        with pytest.raises(ValueError):
            kv.records.flags.writeable = True  # the buffer itself is read-only
