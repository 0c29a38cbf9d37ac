"""CPU absorbed attention: float64 references, fp8 scale hoisting, bitwise split invariance,
strided record views, causal batches, bounded scratch, and input errors.

Tolerances: see tests/kernels/attention_cases.py (F32_RTOL, FP8_VS_F32_RTOL).
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention import SCRATCH_LIMIT_BYTES, absorbed_attention, absorbed_scratch_bytes
from kernels.errors import ColiError, FormatError, ModelMismatchError
from kernels.rows import F32Rows, Fp8Rows
from tests.kernels.attention_cases import (
    F32_RTOL,
    FP8_VS_F32_RTOL,
    latent_rows,
    quantize,
    queries,
    record_array,
    record_view,
    reference_absorbed,
    rel_err,
    split_rows,
)

KV, ROPE, HEADS = 64, 16, 4
SCALE = 1.0 / np.sqrt(48.0 + ROPE)


def _case(seed: int, length: int, n_q: int, gain: float = 1.0):
    rng = np.random.default_rng(seed)
    lc, rc = latent_rows(rng, length, KV, ROPE)
    return lc, rc, queries(rng, n_q, HEADS, KV, gain), queries(rng, n_q, HEADS, ROPE, gain)


@pytest.mark.parametrize("length,n_q,causal", [(1, 1, True), (300, 1, True), (300, 7, True), (300, 7, False),
                                               (1000, 64, True), (64, 64, True)])
def test_f32_matches_float64_reference(length: int, n_q: int, causal: bool) -> None:
    lc, rc, qa, qr = _case(1, length, n_q, gain=0.5)
    got = absorbed_attention(qa, qr, [F32Rows(lc, rc)], SCALE, causal=causal, tile_rows=128)
    assert got.shape == (n_q, HEADS, KV) and got.dtype == np.float32
    assert rel_err(got, reference_absorbed(qa, qr, lc, rc, SCALE, causal)) < F32_RTOL


def test_fp8_matches_dequantised_reference_and_f32_within_tolerance() -> None:
    lc, rc, qa, qr = _case(2, 700, 5, gain=0.5)
    fp8 = quantize(lc, rc)
    got = absorbed_attention(qa, qr, [fp8.rows], SCALE, tile_rows=256)
    assert rel_err(got, reference_absorbed(qa, qr, fp8.lc_deq, fp8.rc_deq, SCALE)) < F32_RTOL
    err_vs_f32 = rel_err(got, reference_absorbed(qa, qr, lc, rc, SCALE))
    assert 1e-4 < err_vs_f32 < FP8_VS_F32_RTOL  # quantisation is visible, and bounded


def test_fp8_nan_codes_and_inert_rows_read_as_zero() -> None:
    lc, rc, qa, qr = _case(3, 200, 3)
    fp8 = quantize(lc, rc)
    codes = fp8.rows.lc_codes.copy()
    codes[5, :10] = 0x7F
    codes[6, 3] = 0xFF
    lsc = fp8.rows.lc_scale.copy()
    rsc = fp8.rows.rc_scale.copy()
    lsc[[10, 11, 12, 13]] = [0.0, -1.0, np.inf, np.nan]  # inert rows (reader rule: scale -> 0)
    rsc[[20, 21]] = [np.nan, 0.0]
    rows = Fp8Rows(codes, lsc, fp8.rows.rc_codes, rsc)
    got = absorbed_attention(qa, qr, [rows], SCALE, tile_rows=64)
    table_lc = np.where((codes & 0x7F) == 0x7F, 0, codes)  # NaN codes read as 0
    ok_l = np.where((lsc > 0) & np.isfinite(lsc), lsc, 0).astype(np.float32)
    ok_r = np.where((rsc > 0) & np.isfinite(rsc), rsc, 0).astype(np.float32)
    from kernels.fp8 import dequantize_rows

    ref = reference_absorbed(qa, qr, dequantize_rows(table_lc.astype(np.uint8), ok_l),
                             dequantize_rows(fp8.rows.rc_codes, ok_r), SCALE)
    assert np.isfinite(got).all()
    assert rel_err(got, ref) < F32_RTOL


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_block_split_is_bitwise_invariant(data: st.DataObject) -> None:
    length = data.draw(st.integers(1, 400), label="T")
    n_q = data.draw(st.integers(1, min(length, 9)), label="S")
    tile = data.draw(st.sampled_from([1, 7, 64, 128, 512]), label="tile")
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, length - 1)), max_size=6), label="cuts")))
    cuts = [c for c in cuts if 0 < c < length]
    lc, rc, qa, qr = _case(length, length, n_q)
    fp8 = quantize(lc, rc)
    for rows in (F32Rows(lc, rc), fp8.rows):
        whole = absorbed_attention(qa, qr, [rows], SCALE, tile_rows=tile)
        split = absorbed_attention(qa, qr, split_rows(rows, cuts), SCALE, tile_rows=tile)
        assert np.array_equal(whole, split)


def test_empty_blocks_are_allowed_anywhere() -> None:
    lc, rc, qa, qr = _case(12, 300, 2)
    fp8 = quantize(lc, rc)
    whole = absorbed_attention(qa, qr, [fp8.rows], SCALE, tile_rows=64)
    blocks = split_rows(fp8.rows, [0, 64, 64, 64, 200, 300])  # empty blocks first, middle and last
    assert sum(b.length == 0 for b in blocks) == 4
    assert np.array_equal(absorbed_attention(qa, qr, blocks, SCALE, tile_rows=64), whole)


def test_strided_record_views_match_contiguous_bitwise() -> None:
    """GLM-5.2 record geometry: 78 layers x (512 + 4 + 64 + 4) + 4 = 45,556 B per row."""
    rng = np.random.default_rng(4)
    lc, rc = latent_rows(rng, 300, 512, 64)
    fp8 = quantize(lc, rc)
    recs = record_array(fp8.rows.lc_codes, fp8.rows.lc_scale, fp8.rows.rc_codes, fp8.rows.rc_scale, 78, 41)
    assert recs.dtype.itemsize == 45_556
    strided = record_view(recs, 41)
    assert strided.lc_codes.strides == (45_556, 1)
    qa, qr = queries(rng, 3, 8, 512, 0.3), queries(rng, 3, 8, 64, 0.3)
    contiguous = absorbed_attention(qa, qr, [fp8.rows], 0.07, tile_rows=128)
    assert np.array_equal(absorbed_attention(qa, qr, [strided], 0.07, tile_rows=128), contiguous)
    views = split_rows(strided, [50, 129, 250])
    assert np.array_equal(absorbed_attention(qa, qr, views, 0.07, tile_rows=128), contiguous)
    f32_strided = np.zeros((300, 3, 512 + 64), np.float32)[:, 1]  # rows 3 x 576 floats apart
    f32_strided[:, :512], f32_strided[:, 512:] = lc, rc
    f32_rows = F32Rows(f32_strided[:, :512], f32_strided[:, 512:])
    assert np.array_equal(absorbed_attention(qa, qr, [f32_rows], 0.07, tile_rows=128),
                          absorbed_attention(qa, qr, [F32Rows(lc, rc)], 0.07, tile_rows=128))


def test_mixed_f32_and_fp8_blocks() -> None:
    lc, rc, qa, qr = _case(5, 500, 4)
    fp8 = quantize(lc, rc)
    blocks = [F32Rows(fp8.lc_deq[:200], fp8.rc_deq[:200])] + split_rows(fp8.rows, [200])[1:]
    got = absorbed_attention(qa, qr, blocks, SCALE, tile_rows=128)
    assert rel_err(got, reference_absorbed(qa, qr, fp8.lc_deq, fp8.rc_deq, SCALE)) < F32_RTOL


def test_causal_batch_equals_one_query_at_a_time() -> None:
    lc, rc, qa, qr = _case(6, 257, 9)
    fp8 = quantize(lc, rc)
    for rows in (F32Rows(lc, rc), fp8.rows):
        batch = absorbed_attention(qa, qr, [rows], SCALE, tile_rows=64)
        for s in range(9):
            upto = 257 - 9 + s + 1  # query s sees rows 0 .. T-S+s
            single = absorbed_attention(qa[s : s + 1], qr[s : s + 1], split_rows(rows, [upto])[:1], SCALE,
                                        tile_rows=64)
            assert rel_err(batch[s], single[0].astype(np.float64)) < F32_RTOL


def test_tile_size_changes_only_rounding_and_calls_are_deterministic() -> None:
    lc, rc, qa, qr = _case(7, 999, 3)
    fp8 = quantize(lc, rc)
    ref = reference_absorbed(qa, qr, fp8.lc_deq, fp8.rc_deq, SCALE)
    outs = [absorbed_attention(qa, qr, [fp8.rows], SCALE, tile_rows=t) for t in (1, 33, 1000, 4096)]
    for out in outs:
        assert rel_err(out, ref) < F32_RTOL
    assert np.array_equal(absorbed_attention(qa, qr, [fp8.rows], SCALE, tile_rows=33), outs[1])


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("fp8", [True, False])
def test_scratch_is_bounded_and_independent_of_length(fp8: bool) -> None:
    """GLM head shapes: extra memory <= 64 MiB and the same at T = 16k and 64k (fp8: the f32
    copy of the cache would be 128 MiB at 64k; it is never made)."""
    rng = np.random.default_rng(8)
    heads, kv, rope = 64, 512, 64
    qa, qr = queries(rng, 1, heads, kv, 0.1), queries(rng, 1, heads, rope, 0.1)
    peaks = []
    for length in (16_384, 65_536):
        if fp8:
            rows = Fp8Rows(rng.integers(0, 256, (length, kv), dtype=np.uint8), np.full(length, 0.01, np.float32),
                           rng.integers(0, 256, (length, rope), dtype=np.uint8), np.full(length, 0.01, np.float32))
        else:
            rows = F32Rows(rng.standard_normal((length, kv), dtype=np.float32),
                           rng.standard_normal((length, rope), dtype=np.float32))
        peaks.append(_peak_bytes(lambda rows=rows: absorbed_attention(qa, qr, [rows], 0.05)))
    output = heads * kv * 4
    assert peaks[1] - output <= SCRATCH_LIMIT_BYTES
    assert abs(peaks[1] - peaks[0]) < 1 << 20  # does not grow with T
    assert peaks[1] <= 2 * absorbed_scratch_bytes(1, heads, kv, rope, 65_536) + 8 * output


def test_large_causal_batch_scratch_is_bounded() -> None:
    rng = np.random.default_rng(9)
    heads, length, n_q = 16, 4096, 2048
    rows = Fp8Rows(rng.integers(0, 256, (length, KV), dtype=np.uint8), np.full(length, 0.01, np.float32),
                   rng.integers(0, 256, (length, ROPE), dtype=np.uint8), np.full(length, 0.01, np.float32))
    qa, qr = queries(rng, n_q, heads, KV, 0.1), queries(rng, n_q, heads, ROPE, 0.1)
    output_state = n_q * heads * (KV + 2) * 4
    peak = _peak_bytes(lambda: absorbed_attention(qa, qr, [rows], 0.05))
    assert peak - 3 * output_state <= SCRATCH_LIMIT_BYTES  # acc, result and the returned array
    assert peak < n_q * heads * length * 4  # far below one [S, H, T] score matrix


def test_bad_inputs_raise_our_errors() -> None:
    lc, rc, qa, qr = _case(10, 20, 2)
    good = F32Rows(lc, rc)
    with pytest.raises(FormatError, match="no cache blocks"):
        absorbed_attention(qa, qr, [], SCALE)
    with pytest.raises(ModelMismatchError, match="q_abs width"):
        absorbed_attention(qa[:, :, :10], qr, [good], SCALE)
    with pytest.raises(FormatError, match="widths"):
        absorbed_attention(qa, qr, [good, F32Rows(lc[:, :32], rc)], SCALE)
    with pytest.raises(FormatError, match="expected float32"):
        absorbed_attention(qa, qr, [F32Rows(lc.astype(np.float64), rc)], SCALE)
    with pytest.raises(FormatError, match="causal queries"):
        rng = np.random.default_rng(0)
        absorbed_attention(queries(rng, 30, HEADS, KV), queries(rng, 30, HEADS, ROPE), [good], SCALE)
    with pytest.raises(FormatError, match=r"\[S, H\]"):
        absorbed_attention(qa, qr[:1], [good], SCALE)
    with pytest.raises(FormatError, match="scales"):
        absorbed_attention(qa, qr, [Fp8Rows(np.zeros((20, KV), np.uint8), np.ones(19, np.float32),
                                            np.zeros((20, ROPE), np.uint8), np.ones(20, np.float32))], SCALE)
    with pytest.raises(ColiError):
        absorbed_attention(qa, qr, ["not rows"], SCALE)  # type: ignore[list-item]
    with pytest.raises(FormatError, match="float array"):
        absorbed_attention(qa.astype(np.int32), qr, [good], SCALE)
