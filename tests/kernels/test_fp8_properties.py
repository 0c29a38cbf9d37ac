"""Property tests (hypothesis) for the fp8 e4m3 codec and the row quantizer."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kernels import fp8
from tests.kernels.test_fp8 import enc_scalar, quantize_row_reference

F32 = np.float32
GRID = fp8.DECODE_TABLE[: 0x7F].astype(np.float64)  # [127] the non-negative values, ascending

any_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
f32_arrays = hnp.arrays(F32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9), elements=any_f32)

SETTINGS = settings(max_examples=200, deadline=None)


@SETTINGS
@given(st.lists(any_f32, min_size=1, max_size=64))
def test_encode_equals_the_single_value_rule(values):
    x = np.array(values, F32)
    assert fp8.encode(x).tolist() == [enc_scalar(float(v)) for v in x]


@SETTINGS
@given(finite_f32.filter(lambda v: abs(v) <= 448))
def test_decoded_value_is_a_nearest_grid_point(value):
    got = float(fp8.decode(fp8.encode(np.array([value], F32)))[0])
    best = np.min(np.abs(GRID - abs(value)))
    assert abs(abs(got) - abs(value)) == best
    assert got == 0 or np.sign(got) == np.sign(value)


@SETTINGS
@given(st.lists(finite_f32, min_size=2, max_size=64))
def test_encode_is_monotonic(values):
    x = np.sort(np.array(values, F32))
    assert (np.diff(fp8.decode(fp8.encode(x)).astype(np.float64)) >= 0).all()


@SETTINGS
@given(st.lists(finite_f32, min_size=1, max_size=64))
def test_sign_symmetry(values):
    x = np.array(values, F32)
    assert np.array_equal(fp8.encode(-x), fp8.encode(x) ^ 0x80)


@SETTINGS
@given(hnp.arrays(np.uint8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9)))
def test_decode_is_the_table_and_reencodes_to_itself(codes):
    values = fp8.decode(codes)
    assert np.array_equal(values, fp8.DECODE_TABLE[codes])
    clean = np.where((codes & 0x7F) == 0x7F, 0, codes)  # NaN codes read as +0.0 -> 0x00
    assert np.array_equal(fp8.encode(values), clean)


@SETTINGS
@given(f32_arrays)
def test_layout_invariance(x):
    want = fp8.encode(x)
    assert np.array_equal(fp8.encode(x.T), want.T)
    assert np.array_equal(fp8.encode(x[..., ::-1]), want[..., ::-1])
    if x.ndim >= 2:  # rows are the last axis: reversing the leading axis reverses the rows
        codes, scales = fp8.quantize_rows(x)
        flipped_codes, flipped_scales = fp8.quantize_rows(x[::-1])
        assert np.array_equal(flipped_codes, codes[::-1])
        assert np.array_equal(flipped_scales, scales[::-1])


@SETTINGS
@given(f32_arrays)
def test_quantize_rows_equals_the_scalar_rule_row_by_row(x):
    codes, scales = fp8.quantize_rows(x)
    rows = x.reshape(-1, x.shape[-1])
    for i, row in enumerate(rows):
        want_codes, want_scale = quantize_row_reference(row)
        assert codes.reshape(rows.shape)[i].tolist() == want_codes
        assert scales.reshape(-1)[i] == F32(want_scale)


@SETTINGS
@given(f32_arrays)
def test_quantize_error_bound(x):
    codes, scales = fp8.quantize_rows(x)
    deq = fp8.dequantize_rows(codes, scales)
    amax = np.fmax.reduce(np.abs(x), axis=-1, initial=F32(0))  # [...] NaN ignored
    quantized = amax <= F32(3.4e38)  # rows above it (or with +-inf) are zero rows
    bound = np.abs(x) / 16 + scales[..., None] * 2.0**-10 + 1e-7
    ok = np.abs(deq.astype(np.float64) - x) <= bound
    assert ok[quantized[..., None] & ~np.isnan(x)].all()
    assert (deq[np.isnan(x)] == 0).all()
    assert (scales[~quantized] == 1).all() and not codes[~quantized].any()


normal_or_zero = st.one_of(
    st.just(0.0), st.floats(2.0**-20, 2.0**20, width=32), st.floats(-(2.0**20), -(2.0**-20), width=32)
)


@SETTINGS
@given(st.lists(normal_or_zero, min_size=1, max_size=40), st.integers(-10, 10))
def test_power_of_two_scaling_changes_only_the_scale(values, k):
    x = np.array(values, F32)
    codes, scale = fp8.quantize_rows(x)
    scaled_codes, scaled_scale = fp8.quantize_rows(x * F32(2.0**k))
    assert np.array_equal(scaled_codes, codes)
    if np.abs(x).max() > 0:
        assert scaled_scale == scale * F32(2.0**k)
    else:
        assert scale == scaled_scale == 1.0
