"""fp8 e4m3 codec: the engine's vectors, every code, ml_dtypes as an independent oracle, the row rule."""
from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest

from kernels import fp8
from kernels.errors import FormatError

F8 = ml_dtypes.float8_e4m3fn
F32 = np.float32


def enc_scalar(f: float) -> int:
    """The engine's single-value rule, written out step by step on Python floats (exact for f32)."""
    if math.isnan(f):
        return 0x00
    sign = 0x80 if math.copysign(1.0, f) < 0 else 0
    a = abs(f)
    if not a <= 448.0:
        return sign | 0x7E
    if a < 2.0**-6:
        return sign | round(a * 2.0**9)  # Python's round() is half to even
    _, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    biased, k = e + 6, round(a * 2.0 ** (4 - e))  # mantissa with hidden bit, 8..16
    if k == 16:
        biased, k = biased + 1, 8
    if biased > 15 or (biased == 15 and k > 14):
        return sign | 0x7E
    return sign | (biased << 3) | (k - 8)


def table_value(b: int) -> float:
    """Decode rule of the format notes for one code."""
    e, m = (b >> 3) & 15, b & 7
    if e == 15 and m == 7:
        return 0.0
    mag = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if b & 0x80 else mag


def ml_oracle(x: np.ndarray) -> np.ndarray:
    """ml_dtypes' RNE cast, clipped to +-448 (it gives NaN above 464), NaN inputs -> 0x00."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        codes = np.clip(x, -448, 448).astype(F8).view(np.uint8).copy()  # [N] u8
    codes[np.isnan(x)] = 0
    return codes


def bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(F32)


# ---------------------------------------------------------------- decode table


def test_decode_table_every_code_matches_the_rule_bitwise():
    expected = np.array([table_value(b) for b in range(256)], dtype=F32)
    assert fp8.DECODE_TABLE.dtype == F32 and fp8.DECODE_TABLE.shape == (256,)
    assert np.array_equal(fp8.DECODE_TABLE.view(np.uint32), expected.view(np.uint32))


def test_decode_table_landmarks_and_nan_codes():
    t = fp8.DECODE_TABLE
    assert t[0x38] == 1.0 and t[0x7E] == 448.0 and t[0xFE] == -448.0
    assert t[0x01] == 2.0**-9 and t[0x08] == 2.0**-6 and t[0x07] == 7 * 2.0**-9
    assert t[0x80] == 0.0 and np.signbit(t[0x80])  # -0.0
    for nan_code in (0x7F, 0xFF):
        assert t[nan_code] == 0.0 and not np.signbit(t[nan_code])  # +0.0, never NaN
    assert np.isfinite(t).all()


def test_decode_table_is_read_only():
    with pytest.raises(ValueError):
        fp8.DECODE_TABLE[1] = 3.0


def test_decode_every_code_against_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    ours = fp8.decode(codes)
    theirs = codes.view(F8).astype(F32)
    ok = (codes & 0x7F) != 0x7F
    assert np.array_equal(ours[ok].view(np.uint32), theirs[ok].view(np.uint32))
    assert np.isnan(theirs[~ok]).all() and (ours[~ok] == 0).all()


def test_every_non_nan_code_round_trips():
    codes = np.array([b for b in range(256) if (b & 0x7F) != 0x7F], dtype=np.uint8)
    assert codes.size == 254
    assert np.array_equal(fp8.encode(fp8.decode(codes)), codes)
    assert fp8.encode(fp8.decode(np.array([0x7F, 0xFF], np.uint8))).tolist() == [0, 0]


# ---------------------------------------------------------------- engine vectors and edge cases

ENGINE_VECTORS = [
    (17.0, 16.0), (19.0, 20.0), (17.1, 18.0), (float.fromhex("0x1.fcp-7"), 2.0**-6),
    (15.9, 16.0), (14.5, 14.0), (15.5, 16.0), (-17.0, -16.0), (-15.5, -16.0),
]


@pytest.mark.parametrize("value, decoded", ENGINE_VECTORS)
def test_engine_vectors(value, decoded):
    code = fp8.encode(np.array([value], F32))
    assert fp8.decode(code)[0] == decoded
    assert int(code[0]) == enc_scalar(float(F32(value)))


EDGE_CODES = [
    (0.0, 0x00), (-0.0, 0x80), (1.0, 0x38), (448.0, 0x7E), (-448.0, 0xFE), (449.0, 0x7E),
    (464.0, 0x7E), (-480.0, 0xFE), (1e30, 0x7E), (float.fromhex("0x1.fffffep127"), 0x7E),
    (math.inf, 0x7E), (-math.inf, 0xFE), (math.nan, 0x00), (-math.nan, 0x00),
    (2.0**-10, 0x00), (-(2.0**-10), 0x80), (1.5 * 2.0**-10, 0x01), (2.5 * 2.0**-9, 0x02),
    (3.5 * 2.0**-9, 0x04), (7.5 * 2.0**-9, 0x08), (2.0**-9, 0x01), (1e-40, 0x00), (-1e-40, 0x80),
    (float.fromhex("0x1p-149"), 0x00), (-1e-10, 0x80), (2.0**-6, 0x08), (240.0, 0x77),
    (1.0625, 0x38), (1.0625 + 2.0**-23, 0x39), (1.1875, 0x3A),
]


@pytest.mark.parametrize("value, code", EDGE_CODES)
def test_edge_values(value, code):
    assert int(fp8.encode(np.array([value], F32))[0]) == code
    assert enc_scalar(float(F32(value))) == code


def test_nan_payloads_and_signs_all_give_zero():
    bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF,
                     0xFFFFFFFF, 0x7F810000, 0x7F80FFFF], np.uint32)
    assert (fp8.encode(bits_to_f32(bits)) == 0).all()
    assert (fp8.encode_reference(bits) == 0).all()


def test_saturation_of_everything_above_448():
    rng = np.random.default_rng(7)
    above = np.concatenate([
        np.nextafter(F32(448), F32(np.inf), dtype=F32)[None],
        rng.uniform(448, 1e6, 20000).astype(F32),
        bits_to_f32(rng.integers(0x43E00001, 0x7F800001, 20000, dtype=np.uint64)),
    ])
    above = above[above > 448]
    assert (fp8.encode(above) == 0x7E).all()
    assert (fp8.encode(-above) == 0xFE).all()


# ---------------------------------------------------------------- oracle sweeps


def test_random_bit_patterns_against_ml_dtypes():
    rng = np.random.default_rng(20260)
    bits = rng.integers(0, 1 << 32, 1 << 24, dtype=np.uint64).astype(np.uint32)  # 16.8M patterns
    x = bits_to_f32(bits)
    assert np.array_equal(fp8.encode(x), ml_oracle(x))


def test_every_positive_f32_in_the_rounding_range_against_ml_dtypes():
    """All 167,772,160 positive f32 in [2^-11, 512): every value whose code takes real rounding.

    Below 2^-11 everything is 0x00 and above 448 everything saturates (tested separately);
    negatives mirror positives (sign test below); the slow file sweeps all 2^32 patterns.
    """
    start, stop, step = 116 << 23, 136 << 23, 1 << 24
    for lo in range(start, stop, step):
        x = bits_to_f32(np.arange(lo, min(stop, lo + step), dtype=np.uint32))
        assert np.array_equal(fp8.encode(x), ml_oracle(x)), hex(lo)


def test_negative_values_mirror_positive_ones():
    rng = np.random.default_rng(21)
    bits = rng.integers(0, 0x7F800000, 1 << 20, dtype=np.uint64).astype(np.uint32)  # finite positives
    x = bits_to_f32(bits)
    assert np.array_equal(fp8.encode(-x), fp8.encode(x) | 0x80)


def test_every_top_half_with_sticky_variants_against_ml_dtypes_and_reference():
    """Every 16-bit top half (sign, exponent, 7 mantissa bits) with low halves that decide ties."""
    rng = np.random.default_rng(5)
    top = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = [0, 1, 0x7FFF, 0x8000, 0xFFFF] + [rng.integers(1, 1 << 16, 1 << 16, dtype=np.uint32)]
    for low in lows:
        bits = top | np.asarray(low, np.uint32)
        x = bits_to_f32(bits)
        ours = fp8.encode(x)
        assert np.array_equal(ours, ml_oracle(x))
        assert np.array_equal(ours, fp8.encode_reference(bits))


def test_ties_and_subnormal_grid_against_ml_dtypes():
    grid = fp8.DECODE_TABLE[np.arange(0, 0x7E)].astype(np.float64)  # [126] non-negative grid
    mids = (grid[:-1] + grid[1:]) / 2  # exact ties (representable in f32)
    mids32 = mids.astype(F32)
    near = np.concatenate([mids32, np.nextafter(mids32, F32(0)), np.nextafter(mids32, F32(1))])
    x = np.concatenate([near, -near]).astype(F32)
    assert np.array_equal(fp8.encode(x), ml_oracle(x))
    assert [enc_scalar(float(v)) for v in x] == fp8.encode(x).tolist()


def test_f32_subnormal_inputs():
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 23, 100000, dtype=np.uint32)
    x = np.concatenate([bits_to_f32(bits), -bits_to_f32(bits)])
    codes = fp8.encode(x)
    assert np.array_equal(codes, ml_oracle(x))
    assert set(np.unique(codes).tolist()) <= {0x00, 0x80}


# ---------------------------------------------------------------- layouts, dtypes, shapes


def test_non_contiguous_inputs_match_the_contiguous_result():
    rng = np.random.default_rng(11)
    base = (rng.standard_normal((600, 300)) * 40).astype(F32)
    cube = (rng.standard_normal((5, 7, 9)) * 40).astype(F32)
    views = [base.T, base[::3, ::2], base[::-1], base[:, 7:19], cube[:, ::2, :], cube.transpose(2, 0, 1),
             cube[..., ::3], np.broadcast_to(base[0], (4, 300)), base.reshape(-1)[::2],
             base.reshape(-1)[::-3]]
    for view in views:
        expected = ml_oracle(np.ascontiguousarray(view).reshape(-1)).reshape(view.shape)
        got = fp8.encode(view)
        assert got.shape == view.shape and np.array_equal(got, expected)
        back = fp8.decode(got.T if got.ndim == 2 else got[..., ::-1])
        want = fp8.DECODE_TABLE[np.ascontiguousarray(got.T if got.ndim == 2 else got[..., ::-1])]
        assert np.array_equal(back, want)


def test_input_dtypes_are_converted_to_float32_first():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(3000) * 30).astype(F32)
    assert np.array_equal(fp8.encode(x.astype(">f4")), fp8.encode(x))
    x64 = rng.standard_normal(3000) * 30
    assert np.array_equal(fp8.encode(x64), fp8.encode(x64.astype(F32)))
    ints = np.arange(-600, 600)
    assert np.array_equal(fp8.encode(ints), fp8.encode(ints.astype(F32)))
    assert fp8.encode([1.0, -2.0]).tolist() == [0x38, 0xC0]
    assert np.array_equal(fp8.decode(np.array([0x38, -1], np.int8)), np.array([1.0, 0.0], F32))


def test_zero_d_and_empty_shapes():
    scalar = fp8.encode(F32(1.0))
    assert scalar.shape == () and scalar.dtype == np.uint8 and int(scalar) == 0x38
    assert fp8.decode(np.uint8(0x38)).shape == () and float(fp8.decode(np.uint8(0x38))) == 1.0
    assert fp8.encode(np.zeros((0, 5), F32)).shape == (0, 5)
    assert fp8.decode(np.zeros((3, 0), np.uint8)).shape == (3, 0)
    codes, scales = fp8.quantize_rows(np.zeros((2, 0), F32))
    assert codes.shape == (2, 0) and scales.tolist() == [1.0, 1.0]
    assert fp8.dequantize_rows(codes, scales).shape == (2, 0)


def test_large_decode_uses_pairs_correctly_at_odd_lengths_and_offsets():
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 256, 300001, dtype=np.uint8)
    assert np.array_equal(fp8.decode(codes), fp8.DECODE_TABLE[codes])
    assert np.array_equal(fp8.decode(codes[1:]), fp8.DECODE_TABLE[codes[1:]])  # odd source offset
    buf = np.zeros(300002, F32)
    fp8.decode_into(codes, buf[1:])  # 4-byte-misaligned destination
    assert np.array_equal(buf[1:], fp8.DECODE_TABLE[codes]) and buf[0] == 0


def test_encode_into_and_decode_into():
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((40, 70)) * 9).astype(F32)
    expected = fp8.encode(x)
    out = np.empty((40, 70), np.uint8)
    assert fp8.encode_into(x, out) is out and np.array_equal(out, expected)
    wide = np.zeros((40, 90), np.uint8)
    fp8.encode_into(x, wide[:, 10:80])  # strided destination
    assert np.array_equal(wide[:, 10:80], expected) and not wide[:, :10].any() and not wide[:, 80:].any()
    out_t = np.empty((70, 40), np.uint8).T  # F-ordered destination
    fp8.encode_into(x, out_t)
    assert np.array_equal(out_t, expected)
    vals = np.empty((40, 70), F32)
    assert fp8.decode_into(expected, vals) is vals and np.array_equal(vals, fp8.DECODE_TABLE[expected])
    vals_t = np.empty((70, 40), F32).T
    fp8.decode_into(expected, vals_t)
    assert np.array_equal(vals_t, fp8.DECODE_TABLE[expected])


@pytest.mark.parametrize("call", [
    lambda: fp8.encode(np.array(["a", "b"])),
    lambda: fp8.encode(np.ones(3, np.complex64)),
    lambda: fp8.encode(np.array([object()])),
    lambda: fp8.decode(np.zeros(3, np.int32)),
    lambda: fp8.decode(np.zeros(3, F32)),
    lambda: fp8.encode_into(np.zeros(3, F32), np.zeros(4, np.uint8)),
    lambda: fp8.encode_into(np.zeros(3, F32), np.zeros(3, np.int16)),
    lambda: fp8.encode_into(np.zeros(3, F32), [0, 0, 0]),
    lambda: fp8.decode_into(np.zeros(3, np.uint8), np.zeros(3, np.float64)),
    lambda: fp8.quantize_rows(F32(1.0)),
    lambda: fp8.dequantize_rows(np.zeros((2, 4), np.uint8), np.ones(3, F32)),
    lambda: fp8.dequantize_rows(np.zeros((2, 4), np.uint8), np.ones(2, np.int32)),
    lambda: fp8.dequantize_rows(np.uint8(3), F32(1.0)),
    lambda: fp8.quantize_rows_into(np.zeros((2, 4), F32), np.zeros((2, 4), np.uint8), np.zeros(3, F32)),
])
def test_bad_arguments_raise_our_error(call):
    with pytest.raises(FormatError):
        call()


def test_read_only_destination_is_refused():
    out = np.zeros(3, np.uint8)
    out.flags.writeable = False
    with pytest.raises(FormatError, match="read-only"):
        fp8.encode_into(np.zeros(3, F32), out)


def test_pair_table():
    pairs = fp8.PAIR_TABLE
    assert pairs is fp8.pair_table()
    assert pairs.shape == (65536, 2) and pairs.dtype == F32 and not pairs.flags.writeable
    idx = np.arange(65536)
    assert np.array_equal(pairs[:, 0], fp8.DECODE_TABLE[idx & 0xFF])
    assert np.array_equal(pairs[:, 1], fp8.DECODE_TABLE[idx >> 8])
    codes = np.random.default_rng(8).integers(0, 256, 512, dtype=np.uint8)
    assert np.array_equal(pairs[codes.view("<u2")].reshape(-1), fp8.decode(codes))
    with pytest.raises(AttributeError):
        fp8.NOT_A_TABLE  # noqa: B018


# ---------------------------------------------------------------- row quantizer


def quantize_row_reference(row: np.ndarray) -> tuple[list[int], float]:
    """The engine's row rule, one row, float32 scalar operations."""
    amax = F32(0)
    for v in row:
        a = F32(abs(v))
        if a > amax:  # NaN never compares greater
            amax = a
    if not amax > F32(1e-35) or amax > F32(3.4e38):
        return [0] * len(row), 1.0
    inv = F32(448) / amax
    return [enc_scalar(float(F32(v) * inv)) for v in row], float(amax / F32(448))


def test_quantize_rows_matches_the_scalar_rule():
    rng = np.random.default_rng(12)
    rows = (rng.standard_normal((48, 37)) * np.exp(rng.uniform(-30, 30, (48, 1)))).astype(F32)
    rows[3, 5] = np.nan
    rows[4, :] = np.nan
    rows[5, 2] = np.inf
    rows[6, :] = 0
    rows[7, :] = rng.standard_normal(37).astype(F32) * F32(1e-38)  # f32 subnormals
    rows[8, :] = [1e-38, -1e-38, 0, 1e-40] * 9 + [0]
    rows[9, 0] = F32(3.4e38)
    codes, scales = fp8.quantize_rows(rows)
    assert codes.dtype == np.uint8 and scales.dtype == F32 and scales.shape == (48,)
    for i, row in enumerate(rows):
        want_codes, want_scale = quantize_row_reference(row)
        assert codes[i].tolist() == want_codes, i
        assert scales[i] == F32(want_scale), i


def test_quantize_rows_special_rows():
    tiny = F32(1e-35)
    rows = np.zeros((8, 4), F32)
    rows[1] = [1e-38, -1e-38, 0, 1e-40]
    rows[2] = [tiny, -tiny, 0, 0]  # amax == 1e-35f: not > 1e-35f
    rows[3] = [np.nextafter(tiny, F32(1)), 0, 0, 0]  # just above: quantized
    rows[4] = [F32(3.4e38), 1, 0, 0]  # amax == 3.4e38f: quantized
    rows[5] = [np.nextafter(F32(3.4e38), F32(np.inf)), 1, 0, 0]  # above: zero row
    rows[6] = [np.nan, np.nan, np.nan, np.nan]
    rows[7] = [-np.inf, 1, 2, 3]
    codes, scales = fp8.quantize_rows(rows)
    for i in (0, 1, 2, 5, 6, 7):
        assert scales[i] == 1.0 and not codes[i].any(), i
    assert codes[3].tolist() == [0x7E, 0, 0, 0] and scales[3] == np.nextafter(tiny, F32(1)) / F32(448)
    assert codes[4, 0] == 0x7E and scales[4] == F32(3.4e38) / F32(448)


def test_quantize_rows_against_ml_dtypes_on_a_large_batch():
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((2000, 576)) * np.exp(rng.uniform(-20, 20, (2000, 1)))).astype(F32)
    codes, scales = fp8.quantize_rows(x)
    amax = np.abs(x).max(axis=1)
    inv = F32(448) / amax
    assert np.array_equal(codes, ml_oracle((x * inv[:, None]).reshape(-1)).reshape(x.shape))
    assert np.array_equal(scales, amax / F32(448))
    assert (np.abs(codes.astype(np.int16) & 0x7F).max(axis=1) == 0x7E).all()  # the amax element hits 448


def test_quantize_rows_error_bound_and_shapes():
    rng = np.random.default_rng(14)
    x = (rng.standard_normal((3, 5, 64)) * np.exp(rng.uniform(-10, 10, (3, 5, 1)))).astype(F32)
    codes, scales = fp8.quantize_rows(x)
    assert codes.shape == (3, 5, 64) and scales.shape == (3, 5)
    deq = fp8.dequantize_rows(codes, scales)
    bound = np.abs(x) / 16 + scales[..., None] * 2.0**-10 + 1e-7
    assert (np.abs(deq - x) <= bound).all()


def test_quantize_rows_of_strided_views_and_into_record_fields():
    rng = np.random.default_rng(15)
    rec = np.dtype([("token", "<i4"), ("lc", "u1", (3, 40)), ("lc_scale", "<f4", (3,))])
    x = (rng.standard_normal((9, 3, 40)) * 5).astype(F32)
    want_codes, want_scales = fp8.quantize_rows(x)
    axis_swapped = np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2)
    for view in (axis_swapped, np.repeat(x, 2, axis=2)[..., ::2]):
        assert not view.flags.c_contiguous and np.array_equal(view, x)
        got_codes, got_scales = fp8.quantize_rows(view)
        assert np.array_equal(got_codes, want_codes) and np.array_equal(got_scales, want_scales)
    records = np.zeros(9, rec)
    fp8.quantize_rows_into(x, records["lc"], records["lc_scale"])  # strided field views
    assert np.array_equal(records["lc"], want_codes) and np.array_equal(records["lc_scale"], want_scales)
    long_row = (rng.standard_normal((2, 70000)) * 3).astype(F32)  # rows longer than one block
    codes, scales = fp8.quantize_rows(long_row[:, ::-1])
    ref_codes, ref_scales = fp8.quantize_rows(np.ascontiguousarray(long_row[:, ::-1]))
    assert np.array_equal(codes, ref_codes) and np.array_equal(scales, ref_scales)


# ---------------------------------------------------------------- dequantize


def test_dequantize_rows_is_table_times_scale_and_inert_rows_read_zero():
    rng = np.random.default_rng(16)
    codes = rng.integers(0, 256, (10, 33), dtype=np.uint8)
    codes[:, 0] = 0xFE  # a negative code in every row
    scales = np.array([1.0, 0.5, 3e-3, 0.0, -1.0, np.nan, np.inf, F32(3.4e38),
                       np.nextafter(F32(3.4e38), F32(0)), 1e-45], F32)
    out = fp8.dequantize_rows(codes, scales)
    assert out.dtype == F32 and out.shape == (10, 33)
    usable = [0, 1, 2, 8, 9]
    for i in range(10):
        if i in usable:
            with np.errstate(over="ignore"):  # row 8: 448 * (3.4e38 - ulp) overflows, as in the engine
                want = fp8.DECODE_TABLE[codes[i]] * scales[i]
            assert np.array_equal(out[i], want), i
        else:  # not (scale > 0 and scale < 3.4e38f): inert, +0.0 exactly
            assert not out[i].view(np.uint32).any(), i
    nan_codes = np.array([[0x7F, 0xFF, 0x38]], np.uint8)
    assert fp8.dequantize_rows(nan_codes, np.array([2.0], F32)).tolist() == [[0.0, 0.0, 2.0]]


def test_dequantize_rows_into_strided_views():
    rng = np.random.default_rng(17)
    codes = rng.integers(0, 256, (6, 4, 50), dtype=np.uint8)
    scales = rng.uniform(0.1, 2, (6, 4)).astype(F32)
    want = fp8.dequantize_rows(codes, scales)
    got = fp8.dequantize_rows(codes[:, ::-1].copy()[:, ::-1], scales[:, ::-1].copy()[:, ::-1])
    assert np.array_equal(got, want)
    out = np.zeros((6, 4, 60), F32)
    fp8.dequantize_rows_into(codes, scales, out[..., 5:55])
    assert np.array_equal(out[..., 5:55], want)


def test_quantize_rows_of_read_only_and_many_block_inputs_match_the_scalar_rule():
    """The compiled quantizer takes read-only rows (a file's mapping) and inputs of several
    blocks, with the same bytes as the scalar rule."""
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((3000, 40)) * np.exp(rng.uniform(-25, 25, (3000, 1)))).astype(F32)  # > one block
    x[::97, 3] = np.nan
    frozen = x.copy()
    frozen.setflags(write=False)
    codes, scales = fp8.quantize_rows(x)
    codes_ro, scales_ro = fp8.quantize_rows(frozen)
    assert np.array_equal(codes, codes_ro) and np.array_equal(scales.view(np.uint32), scales_ro.view(np.uint32))
    for i in range(0, 3000, 149):
        want_codes, want_scale = quantize_row_reference(x[i])
        assert codes[i].tolist() == want_codes and scales[i] == F32(want_scale), i
