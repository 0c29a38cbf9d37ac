"""Sparse absorbed attention (DSA): each query over its selected rows equals dense attention restricted
to those rows (f32, fp8, v3 4-bit rows); bitwise the same for any block split; bounded scratch; bad
selections refused."""
from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

from kernels.attention import absorbed_attention, sparse_absorbed_attention, sparse_scratch_bytes
from kernels.backend import get_backend
from kernels.errors import FormatError
from kernels.rows import F32Rows, TqRows
from kernels.tq import TqCodec
from tests.kernels.attention_cases import (
    F32_RTOL,
    latent_rows,
    quantize,
    queries,
    record_array,
    record_view,
    reference_absorbed,
    rel_err,
    split_rows,
)

T, KV, ROPE, H, S, K = 300, 64, 16, 4, 3, 40
SCALE = 0.11


def selections(rng: np.random.Generator, n_q: int, length: int, k: int) -> np.ndarray:
    """[S, k] ascending rows, query s seeing rows <= length - n_q + s (its own row always chosen)."""
    out = np.empty((n_q, k), np.int64)
    for s in range(n_q):
        pos = length - n_q + s
        out[s] = np.sort(np.append(rng.choice(pos, size=k - 1, replace=False), pos))
    return out


@pytest.fixture(scope="module")
def case() -> dict:
    rng = np.random.default_rng(7)
    lc, rc = latent_rows(rng, T, KV, ROPE)
    return dict(lc=lc, rc=rc, fp8=quantize(lc, rc), q_abs=queries(rng, S, H, KV, 0.2),
                q_rope=queries(rng, S, H, ROPE, 0.2), sel=selections(rng, S, T, K))


def dense_over_selected(q_abs, q_rope, lc, rc, sel) -> np.ndarray:
    """Dense absorbed attention of each query over a cache made of only its selected rows."""
    return np.concatenate([
        absorbed_attention(q_abs[s : s + 1], q_rope[s : s + 1], [F32Rows(lc[sel[s]], rc[sel[s]])], SCALE,
                           causal=False)
        for s in range(sel.shape[0])
    ])  # [S, H, kv_lora]


def test_f32_equals_dense_attention_restricted_to_the_selected_rows(case: dict) -> None:
    got = sparse_absorbed_attention(case["q_abs"], case["q_rope"], [F32Rows(case["lc"], case["rc"])], case["sel"],
                                    SCALE)
    dense = dense_over_selected(case["q_abs"], case["q_rope"], case["lc"], case["rc"], case["sel"])
    assert got.shape == (S, H, KV) and np.array_equal(got, dense)  # the same tile arithmetic, the same bits
    for s in range(S):
        ref = reference_absorbed(case["q_abs"][s : s + 1], case["q_rope"][s : s + 1], case["lc"][case["sel"][s]],
                                 case["rc"][case["sel"][s]], SCALE, causal=False)
        assert rel_err(got[s : s + 1], ref) < F32_RTOL


def test_fp8_equals_the_reference_on_the_dequantised_selected_rows(case: dict) -> None:
    q = case["fp8"]
    got = sparse_absorbed_attention(case["q_abs"], case["q_rope"], [q.rows], case["sel"], SCALE)
    for s in range(S):
        ref = reference_absorbed(case["q_abs"][s : s + 1], case["q_rope"][s : s + 1], q.lc_deq[case["sel"][s]],
                                 q.rc_deq[case["sel"][s]], SCALE, causal=False)
        assert rel_err(got[s : s + 1], ref) < F32_RTOL


@pytest.mark.parametrize("cuts", [[1], [37, 38, 150], [299], [100, 200]])
@pytest.mark.parametrize("tile_rows", [1024, 16, 7])
def test_bitwise_identical_for_any_block_split(case: dict, cuts: list[int], tile_rows: int) -> None:
    q, sel = case["fp8"], case["sel"]
    f32_whole = sparse_absorbed_attention(case["q_abs"], case["q_rope"], [F32Rows(case["lc"], case["rc"])], sel,
                                          SCALE, tile_rows=tile_rows)
    f32_split = sparse_absorbed_attention(case["q_abs"], case["q_rope"], split_rows(F32Rows(case["lc"], case["rc"]),
                                          cuts), sel, SCALE, tile_rows=tile_rows)
    assert np.array_equal(f32_whole, f32_split)
    fp8_whole = sparse_absorbed_attention(case["q_abs"], case["q_rope"], [q.rows], sel, SCALE, tile_rows=tile_rows)
    recs = record_array(q.rows.lc_codes, q.rows.lc_scale, q.rows.rc_codes, q.rows.rc_scale, 3, 2)
    strided = split_rows(record_view(recs, 2), cuts)  # file-like strided views
    assert np.array_equal(fp8_whole, sparse_absorbed_attention(case["q_abs"], case["q_rope"], strided, sel, SCALE,
                                                               tile_rows=tile_rows))
    if tile_rows < K:  # more than one tile per query: the online softmax joins them
        assert rel_err(f32_whole, dense_over_selected(case["q_abs"], case["q_rope"], case["lc"], case["rc"], sel)
                       .astype(np.float64)) < F32_RTOL


def test_mixed_fp8_then_f32_blocks(case: dict) -> None:
    q, sel = case["fp8"], case["sel"]
    blocks = [*split_rows(q.rows, [120])[:1], F32Rows(case["lc"][120:], case["rc"][120:])]
    got = sparse_absorbed_attention(case["q_abs"], case["q_rope"], blocks, sel, SCALE)
    lc = np.concatenate([q.lc_deq[:120], case["lc"][120:]])
    rc = np.concatenate([q.rc_deq[:120], case["rc"][120:]])
    for s in range(S):
        ref = reference_absorbed(case["q_abs"][s : s + 1], case["q_rope"][s : s + 1], lc[sel[s]], rc[sel[s]], SCALE,
                                 causal=False)
        assert rel_err(got[s : s + 1], ref) < F32_RTOL


def test_the_cpu_backend_exposes_it(case: dict) -> None:
    blocks = [F32Rows(case["lc"], case["rc"])]
    got = get_backend("cpu").sparse_absorbed_attention(case["q_abs"], case["q_rope"], blocks, case["sel"], SCALE)
    assert np.array_equal(got, sparse_absorbed_attention(case["q_abs"], case["q_rope"], blocks, case["sel"], SCALE))


def test_scratch_is_bounded_and_no_copy_of_the_cache_is_made() -> None:
    rng = np.random.default_rng(1)
    length, kv, rope, heads, k = 40000, 128, 16, 4, 64
    lc, rc = latent_rows(rng, length, kv, rope, outliers=False)
    q = quantize(lc, rc)
    q_abs, q_rope = queries(rng, 1, heads, kv), queries(rng, 1, heads, rope)
    sel = selections(rng, 1, length, k)
    tracemalloc.start()
    try:
        sparse_absorbed_attention(q_abs, q_rope, [q.rows], sel, SCALE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    cache_bytes = q.rows.lc_codes.nbytes + q.rows.rc_codes.nbytes
    assert peak < sparse_scratch_bytes(heads, kv, rope, k) + 64 * 1024
    assert peak < cache_bytes / 20


@pytest.mark.parametrize(
    "sel, text",
    [
        ([[0, 5, 5]], "ascend"),
        ([[3, 2, 1]], "ascend"),
        ([[-1, 2, 3]], r"\[0, T - S \+ s\]"),
        ([[1, 2, T]], r"\[0, T - S \+ s\]"),
        ([[0.0, 1.0, 2.0]], "integers"),
        ([[0, 1]] * 2, "integers"),
    ],
)
def test_bad_selections_refused(case: dict, sel: list, text: str) -> None:
    with pytest.raises(FormatError, match=text):
        sparse_absorbed_attention(case["q_abs"][:1], case["q_rope"][:1], [F32Rows(case["lc"], case["rc"])],
                                  np.array(sel), SCALE)


def test_a_query_may_not_select_a_row_after_its_own() -> None:
    rng = np.random.default_rng(0)
    lc, rc = latent_rows(rng, 10, KV, ROPE)
    q_abs, q_rope = queries(rng, 2, H, KV), queries(rng, 2, H, ROPE)
    ok = np.array([[0, 8], [3, 9]])  # queries at positions 8 and 9
    sparse_absorbed_attention(q_abs, q_rope, [F32Rows(lc, rc)], ok, SCALE)
    with pytest.raises(FormatError, match="T - S"):
        sparse_absorbed_attention(q_abs, q_rope, [F32Rows(lc, rc)], np.array([[0, 9], [3, 9]]), SCALE)


@pytest.mark.parametrize("kv_dtype", ["int4", "polar4"])
def test_v3_rows_equal_the_reference_on_their_decoded_selected_rows(case: dict, kv_dtype: str) -> None:
    codec = TqCodec.from_kv_dtype(kv_dtype)
    lc_codes, lc_radius = codec.encode_rows(case["lc"])
    rc_codes, rc_radius = codec.encode_rows(case["rc"])
    rows = TqRows(lc_codes, lc_radius, rc_codes, rc_radius, codec, KV, ROPE)
    lc, rc = codec.decode_rows(lc_codes, lc_radius, KV), codec.decode_rows(rc_codes, rc_radius, ROPE)
    sel = case["sel"]
    got = sparse_absorbed_attention(case["q_abs"], case["q_rope"], split_rows_tq(rows, [90, 200]), sel, SCALE)
    for s in range(S):
        ref = reference_absorbed(case["q_abs"][s : s + 1], case["q_rope"][s : s + 1], lc[sel[s]], rc[sel[s]], SCALE,
                                 causal=False)
        assert rel_err(got[s : s + 1], ref) < F32_RTOL


def split_rows_tq(rows: TqRows, cuts: list[int]) -> list[TqRows]:
    edges = [0, *cuts, rows.length]
    return [dataclasses.replace(rows, lc_codes=rows.lc_codes[a:b], lc_radius=rows.lc_radius[a:b],
                                rc_codes=rows.rc_codes[a:b], rc_radius=rows.rc_radius[a:b])
            for a, b in zip(edges[:-1], edges[1:], strict=True)]
