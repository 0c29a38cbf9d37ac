"""Absorbed attention over v3 rows (TqRows) in the rotated domain vs absorbed attention over the
same rows decoded to f32 (``decode_rows``): both codecs, several block splits, causal prefill and
decode, strided record views, inert rows; the decoded-row gatherer for expanded/sparse paths.

Tolerance: TQ_RTOL on max |a - b| / max |b| (the rotated-domain path multiplies the hoisted
factor after the dot product and unrotates the context once, so only f32 rounding differs).
"""
from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from kernels.attention import absorbed_attention, mla_attention
from kernels.attention.tiles import TileGatherer, cache_shape
from kernels.errors import FormatError
from kernels.rows import F32Rows, Fp8Rows, TqRows
from kernels.tq import TqCodec
from tests.kernels.attention_cases import latent_rows, queries, reference_absorbed, rel_err

TQ_RTOL = 2e-5
HEADS = 4
CODECS = [TqCodec("int4", 4), TqCodec("polar", 4), TqCodec("polar", 2), TqCodec("polar", 6)]


def encode(codec: TqCodec, lc: np.ndarray, rc: np.ndarray) -> tuple[TqRows, F32Rows]:
    lcode, lrad = codec.encode_rows(lc)
    rcode, rrad = codec.encode_rows(rc)
    rows = TqRows(lcode, lrad, rcode, rrad, codec, lc.shape[1], rc.shape[1])
    return rows, decoded(rows)


def decoded(rows: TqRows) -> F32Rows:
    c = rows.codec
    return F32Rows(c.decode_rows(rows.lc_codes, rows.lc_radius, rows.kv_lora),
                   c.decode_rows(rows.rc_codes, rows.rc_radius, rows.qk_rope))


def split(rows: TqRows, cuts: list[int]) -> list[TqRows]:
    edges = [0, *cuts, rows.length]
    return [TqRows(rows.lc_codes[a:b], rows.lc_radius[a:b], rows.rc_codes[a:b], rows.rc_radius[a:b], rows.codec,
                   rows.kv_lora, rows.qk_rope) for a, b in pairwise(edges)]


def case(seed: int, length: int, n_q: int, kv: int = 64, rope: int = 16):
    rng = np.random.default_rng(seed)
    lc, rc = latent_rows(rng, length, kv, rope)
    return lc, rc, queries(rng, n_q, HEADS, kv, 0.3), queries(rng, n_q, HEADS, rope, 0.3), 1.0 / np.sqrt(kv)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.kv_dtype)
@pytest.mark.parametrize("length,n_q,causal", [(1, 1, True), (300, 1, True), (300, 9, True), (300, 9, False),
                                               (129, 129, True)])
def test_matches_attention_over_decoded_rows(codec: TqCodec, length: int, n_q: int, causal: bool) -> None:
    lc, rc, qa, qr, scale = case(1, length, n_q)
    tq, f32 = encode(codec, lc, rc)
    got = absorbed_attention(qa, qr, [tq], scale, causal=causal, tile_rows=64)
    want = absorbed_attention(qa, qr, [f32], scale, causal=causal, tile_rows=64)
    assert got.shape == want.shape and got.dtype == np.float32
    assert rel_err(got, want.astype(np.float64)) < TQ_RTOL
    ref = reference_absorbed(qa, qr, f32.lc, f32.rc, scale, causal)
    assert rel_err(got, ref) < TQ_RTOL
    if length > 1:  # the codec is lossy: attention over the original rows differs visibly
        assert rel_err(got, reference_absorbed(qa, qr, lc, rc, scale, causal)) > 1e-4


@pytest.mark.parametrize("codec", CODECS[:2], ids=lambda c: c.kv_dtype)
def test_bitwise_identical_for_any_split(codec: TqCodec) -> None:
    lc, rc, qa, qr, scale = case(2, 700, 5)
    tq, _ = encode(codec, lc, rc)
    whole = absorbed_attention(qa, qr, [tq], scale, tile_rows=128)
    for cuts in ([1], [127, 128, 129], [300, 300, 301], [5, 64, 200, 511, 699]):
        assert np.array_equal(absorbed_attention(qa, qr, split(tq, cuts), scale, tile_rows=128), whole)


@pytest.mark.parametrize("codec", CODECS[:2], ids=lambda c: c.kv_dtype)
def test_glm_widths_decode_and_prefill(codec: TqCodec) -> None:
    lc, rc, qa, qr, scale = case(3, 200, 3, kv=512, rope=64)
    tq, f32 = encode(codec, lc, rc)
    for n_q in (1, 3):
        got = absorbed_attention(qa[:n_q], qr[:n_q], split(tq, [77]), scale, tile_rows=64)
        want = absorbed_attention(qa[:n_q], qr[:n_q], [f32], scale, tile_rows=64)
        assert rel_err(got, want.astype(np.float64)) < TQ_RTOL


def record_rows(tq: TqRows, n_layers: int, layer: int) -> TqRows:
    """The rows as one layer of v3-style records (token, L x (Lc, Lsc, Rc, Rsc)): strided views."""
    rbl, rbr = tq.lc_codes.shape[1], tq.rc_codes.shape[1]
    lay = np.dtype([("lc", "u1", (rbl,)), ("lr", "<f4"), ("rc", "u1", (rbr,)), ("rr", "<f4")])
    recs = np.zeros(tq.length, np.dtype([("token", "<i4"), ("layers", lay, (n_layers,))]))
    v = recs["layers"][:, layer]
    v["lc"], v["lr"], v["rc"], v["rr"] = tq.lc_codes, tq.lc_radius, tq.rc_codes, tq.rc_radius
    v = recs["layers"][:, layer]
    return TqRows(v["lc"], v["lr"], v["rc"], v["rr"], tq.codec, tq.kv_lora, tq.qk_rope)


@pytest.mark.parametrize("codec", CODECS[:2], ids=lambda c: c.kv_dtype)
def test_strided_record_views_give_the_same_bits(codec: TqCodec) -> None:
    lc, rc, qa, qr, scale = case(4, 250, 2)
    tq, _ = encode(codec, lc, rc)
    view = record_rows(tq, 3, 1)
    assert view.lc_codes.strides[0] != view.lc_codes.shape[1]
    assert np.array_equal(absorbed_attention(qa, qr, [view], scale, tile_rows=100),
                          absorbed_attention(qa, qr, [tq], scale, tile_rows=100))


@pytest.mark.parametrize("codec", CODECS[:2], ids=lambda c: c.kv_dtype)
def test_inert_rows_contribute_exact_zeros(codec: TqCodec) -> None:
    lc, rc, qa, qr, scale = case(5, 120, 2)
    lc[[3, 4]] = 0.0
    lc[5, 7] = np.nan
    tq, _ = encode(codec, lc, rc)
    lrad, rrad = tq.lc_radius.copy(), tq.rc_radius.copy()
    lrad[[10, 11, 12]] = [np.nan, -2.0, np.float32(3.4e38)]  # reading rule: inert
    rrad[[20, 21]] = [np.inf, np.nan]
    bad = TqRows(tq.lc_codes, lrad, tq.rc_codes, rrad, codec, tq.kv_lora, tq.qk_rope)
    dec = decoded(bad)
    assert np.all(dec.lc[[3, 4, 5, 10, 11, 12]] == 0) and np.all(dec.rc[[20, 21]] == 0)
    got = absorbed_attention(qa, qr, [bad], scale, tile_rows=32)
    assert np.isfinite(got).all()
    assert rel_err(got, reference_absorbed(qa, qr, dec.lc, dec.rc, scale)) < TQ_RTOL


def test_expanded_mla_and_gather_at_see_decoded_rows() -> None:
    codec = TqCodec("polar", 3)
    lc, rc, _, qr, scale = case(6, 90, 4)
    tq, f32 = encode(codec, lc, rc)
    rng = np.random.default_rng(6)
    qn = queries(rng, 4, HEADS, 8, 0.3)
    w_uk = rng.standard_normal((HEADS, 8, 64)).astype(np.float32) * 0.2
    w_uv = rng.standard_normal((HEADS, 12, 64)).astype(np.float32) * 0.2
    for path in ("absorbed", "expanded"):
        got = mla_attention(qn, qr, split(tq, [40]), w_uk, w_uv, scale, path=path)  # type: ignore[arg-type]
        want = mla_attention(qn, qr, [f32], w_uk, w_uv, scale, path=path)  # type: ignore[arg-type]
        assert rel_err(got, want.astype(np.float64)) < TQ_RTOL
    blocks = split(tq, [33, 60])
    gather = TileGatherer(blocks, cache_shape(blocks), 16)
    pos = np.array([0, 5, 32, 33, 34, 59, 60, 89])
    assert not gather.gather_at(pos)
    assert np.array_equal(gather.lc[: pos.size], f32.lc[pos]) and np.array_equal(gather.rc[: pos.size], f32.rc[pos])
    rot = TileGatherer(blocks, cache_shape(blocks), 16, tq_rotated=True)
    assert rot.gather_at(pos)
    assert np.array_equal(rot.lsc[: pos.size], codec.row_scale(tq.lc_radius[pos], 64))


def test_mixed_or_inconsistent_blocks_are_refused() -> None:
    lc, rc, qa, qr, scale = case(7, 40, 1)
    tq, f32 = encode(TqCodec("int4", 4), lc, rc)
    fp8 = Fp8Rows(np.zeros((4, 64), np.uint8), np.ones(4, np.float32), np.zeros((4, 16), np.uint8),
                  np.ones(4, np.float32))
    for other in (f32, fp8):
        with pytest.raises(FormatError, match="mixed"):
            absorbed_attention(qa, qr, [tq, other], scale)
    p4, _ = encode(TqCodec("polar", 4), lc, rc)
    with pytest.raises(FormatError, match="block 1"):
        absorbed_attention(qa, qr, [tq, p4], scale)
    with pytest.raises(FormatError, match="lc_codes"):
        absorbed_attention(qa, qr, [TqRows(tq.lc_codes[:, :-1], tq.lc_radius, tq.rc_codes, tq.rc_radius, tq.codec,
                                           64, 16)], scale)
    with pytest.raises(FormatError, match="lc_radius"):
        absorbed_attention(qa, qr, [TqRows(tq.lc_codes, tq.lc_radius.astype(np.float64), tq.rc_codes,
                                           tq.rc_radius, tq.codec, 64, 16)], scale)
    with pytest.raises(FormatError, match="power of two"):
        absorbed_attention(qa, qr, [TqRows(tq.lc_codes, tq.lc_radius, tq.rc_codes, tq.rc_radius, tq.codec,
                                           64, 24)], scale)
    empty = split(tq, [0])[0]
    with pytest.raises(FormatError, match="no rows"):
        absorbed_attention(qa, qr, [empty], scale)
