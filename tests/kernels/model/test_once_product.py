"""The compiled step's product for big weights (kernels.model.once_product: every weight read once
per step for all rows): bitwise the row kernels the reference step uses, each row what it gives
alone whatever the batch; and the compiled step over it (every product forced that way on
tiny-glm, and a model whose dense MLP is past ``THREADED_BYTES``) bitwise the reference step."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels.model import GlmDecoder, MLADecoder, load_model
from kernels.model.compiled_step import CompiledStep
from kernels.model.config import parse_config
from kernels.model.once_product import (
    K_BLOCK,
    ROWS,
    gather_panels,
    gather_times,
    heads_once,
    heads_step,
    packed_times,
    panel_order,
    panel_times,
    step_times,
)
from kernels.model.packed_weights import packable
from kernels.model.rowwise import THREADED_BYTES, column_block, heads_times, rows_times
from kernels.model.tiny_glm import tiny_glm_config_dict, tiny_glm_weights
from kernels.model.weights import DictWeights


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 21, 37])
def test_gather_times_is_rows_times_bitwise(rows: int) -> None:
    rng = np.random.default_rng(rows)
    x, wt = _rand(rng, rows, 300), _rand(rng, 300, 700)  # 700 columns: two full tiles and a partial one
    want = np.empty((rows, 700), np.float32)
    rows_times(x, wt, want, column_block(300, 700))
    idx = np.arange(rows)
    got = np.full((rows, 700), np.nan, np.float32)
    gather_times(x, idx, wt, got, idx)
    assert np.array_equal(got, want)
    via = np.full((rows, 700), np.nan, np.float32)
    step_times(x, wt, via, column_block(300, 700), 0, np.arange(64))  # past 0 bytes: the once kernel
    assert np.array_equal(via, want)
    panels = panel_order(wt)  # 700 columns: not whole panels, kept as they are
    assert panels is wt
    wide = _rand(rng, 300, 704)  # 44 panels
    want_wide = np.empty((rows, 704), np.float32)
    rows_times(x, wide, want_wide, column_block(300, 704))
    for fn in (gather_panels, lambda *a: packed_times(*a, 0), panel_times):
        got_wide = np.full((rows, 704), np.nan, np.float32)
        fn(x, idx, panel_order(wide), got_wide, idx)
        assert np.array_equal(got_wide, want_wide)
    via_wide = np.full((rows, 704), np.nan, np.float32)
    step_times(x, panel_order(wide), via_wide, 256, 0, np.arange(64))
    assert np.array_equal(via_wide, want_wide)
    for b in range(rows):  # each row alone: the same bits (batch invariance)
        alone = np.empty((1, 700), np.float32)
        gather_times(x[b : b + 1], idx[:1], wt, alone, idx[:1])
        assert np.array_equal(alone[0], want[b])
        alone_wide = np.empty((1, 704), np.float32)
        gather_panels(x[b : b + 1], idx[:1], panel_order(wide), alone_wide, idx[:1])
        assert np.array_equal(alone_wide[0], want_wide[b])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7])
def test_gather_panels_is_rows_times_bitwise_for_every_tile_width(rows: int) -> None:
    """31 panels: groups of 4, then 3, which each row count's register tiles split widest first down
    to one panel (4/2/1 for one to three rows, 4/1 for four; on AVX2, kernels.model.simd_tile's
    TILE_VECTORS: 4/2/1 for one row, 2/1 for two, 1 for three, four as two pairs)."""
    rng = np.random.default_rng(100 + rows)
    x, wt = _rand(rng, rows, 129), _rand(rng, 129, 31 * 16)  # x: [rows, 129], wt: [129, 496] f32
    want = np.empty((rows, 496), np.float32)
    rows_times(x, wt, want, column_block(129, 496))
    idx = np.arange(rows)
    got = np.full((rows, 496), np.nan, np.float32)
    gather_panels(x, idx, panel_order(wt), got, idx)
    assert np.array_equal(got, want)
    picked = np.full((2 * rows, 496), np.nan, np.float32)  # scattered to odd out rows, gathered reversed
    gather_panels(x, idx[::-1].copy(), panel_order(wt), picked, 2 * idx + 1)
    assert np.array_equal(picked[1::2], want[::-1])
    assert np.isnan(picked[::2]).all()


@pytest.mark.parametrize("rows", [1, 4, 5, 7])
def test_gather_panels_in_k_blocks_is_rows_times_bitwise(rows: int) -> None:
    """Past four rows k goes in blocks of K_BLOCK, each sum carried on in out between them: over
    2 * K_BLOCK + 3 rows of k (two whole blocks and a short one) the bits are still one chain's,
    and each row alone (one pass over all of k) gives its own bits."""
    rng = np.random.default_rng(200 + rows)
    depth = 2 * K_BLOCK + 3
    x, wt = _rand(rng, rows, depth), _rand(rng, depth, 7 * 16)  # x: [rows, depth], wt: [depth, 112] f32
    x[:, ::5] *= np.float32(1e-3)  # sums that round differently when contracted or reordered
    want = np.empty((rows, 112), np.float32)
    rows_times(x, wt, want, column_block(depth, 112))
    idx, panels = np.arange(rows), panel_order(wt)
    got = np.full((rows, 112), np.nan, np.float32)
    gather_panels(x, idx, panels, got, idx)
    assert np.array_equal(got, want)
    for b in range(rows):
        alone = np.full((1, 112), np.nan, np.float32)
        gather_panels(x[b : b + 1], idx[:1], panels, alone, idx[:1])
        assert np.array_equal(alone[0], want[b])


def test_gather_times_gathers_and_scatters() -> None:
    rng = np.random.default_rng(7)
    x, wt = _rand(rng, 9, 64), _rand(rng, 64, 300)
    xi, oi = np.array([8, 0, 3, 3, 5]), np.array([4, 9, 0, 2, 7])
    out = np.zeros((10, 300), np.float32)
    gather_times(x, xi, wt, out, oi)
    want = np.empty((9, 300), np.float32)
    rows_times(x, wt, want, column_block(64, 300))
    assert all(np.array_equal(out[o], want[i]) for i, o in zip(xi, oi, strict=True))
    assert not out[[1, 3, 5, 6, 8]].any()  # rows not named stay as they were
    wide = _rand(rng, 64, 320)  # 20 panels
    out_p = np.zeros((10, 320), np.float32)
    gather_panels(x, xi, panel_order(wide), out_p, oi)
    want_p = np.empty((9, 320), np.float32)
    rows_times(x, wide, want_p, column_block(64, 320))
    assert all(np.array_equal(out_p[o], want_p[i]) for i, o in zip(xi, oi, strict=True))
    assert not out_p[[1, 3, 5, 6, 8]].any()


@pytest.mark.parametrize("rows", [1, 5, ROWS + 3])
def test_heads_once_is_heads_times_bitwise(rows: int) -> None:
    rng = np.random.default_rng(100 + rows)
    x, w = _rand(rng, rows, 3, 40), _rand(rng, 3, 40, 72)
    want = np.empty((rows, 3, 72), np.float32)
    heads_times(x, w, want)
    idx = np.arange(rows, dtype=np.int64)
    for fn in (lambda o: heads_once(x, w, o), lambda o: heads_step(x, w, o, 0, idx),
               lambda o: heads_step(x, w, o, 1 << 40, idx)):  # past 0 bytes: the once kernel; else the tiles
        got = np.full((rows, 3, 72), np.nan, np.float32)
        fn(got)
        assert np.array_equal(got, want)


def _steps(model: MLADecoder) -> tuple[list[np.ndarray], list[Any]]:
    """Sessions of several lengths (some past index_topk), then steps mixing decode tokens and chunks."""
    caches = []
    for i, n in enumerate((3, 15, 31, 22)):
        cache = model.new_cache("fp8")
        model.forward(np.random.default_rng(10 + i).integers(0, 256, n).astype(np.int32), cache)
        caches.append(cache)
    logits = []
    for s, counts in enumerate([[1] * 4, [1, 5, 1, 3], [2, 1, 17, 1]]):
        toks = np.random.default_rng(100 + s).integers(0, 256, sum(counts)).astype(np.int32)
        logits.append(model.step(caches, toks, counts))
    return logits, [c.records_since(0) for c in caches]


def _bitwise_the_reference(model: GlmDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = CompiledStep.run
    monkeypatch.setattr(CompiledStep, "run", lambda self, h, *a: calls.append(h.shape[0]) or real(self, h, *a))
    compiled = _steps(model)
    assert calls, "the compiled step did not run"
    model.use_compiled = False
    reference = _steps(model)
    for a, b in zip(compiled[0], reference[0], strict=True):
        assert np.array_equal(a, b)
    for ra, rb in zip(compiled[1], reference[1], strict=True):
        for name in ("tokens", "lc_codes", "lc_scale", "rc_codes", "rc_scale", "index"):
            assert np.array_equal(getattr(ra, name), getattr(rb, name)), name


def test_every_product_read_once_is_bitwise_the_reference(tiny_glm_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(tiny_glm_dir)  # a fresh model: its step not yet packed
    assert isinstance(model, GlmDecoder)
    model.once_bytes = 0  # every projection, head product, expert and lm_head through once_product
    _bitwise_the_reference(model, monkeypatch)


def test_weights_past_threaded_bytes_take_the_compiled_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense MLP of 512 x 4,608 f32 (9.4 MB, past THREADED_BYTES) beside small weights: the
    compiled step serves it (GLM-5.2's dims used to keep the reference step), bitwise."""
    d = {**tiny_glm_config_dict(), "hidden_size": 512, "intermediate_size": 4608, "num_hidden_layers": 2,
         "mlp_layer_types": ["dense", "sparse"], "indexer_types": ["full", "shared"]}
    config = parse_config(d, source="test-big-dense")
    assert 512 * 4608 * 4 > THREADED_BYTES
    model = GlmDecoder(config, DictWeights(tiny_glm_weights(config, 5), source="test-big-dense"))
    assert packable(model) is None
    _bitwise_the_reference(model, monkeypatch)
