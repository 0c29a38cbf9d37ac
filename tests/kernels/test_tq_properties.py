"""v3 codec properties: the FWHT against the engine's scalar loop, self-inverse and orthogonal;
the engine's quality bounds; encode/decode on random rows (hypothesis), garbage in -> our errors."""
from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kernels.errors import ColiError
from kernels.tq import SIGNS, TqCodec, fwht, rotate, unrotate
from kernels.tq.libm_kernel import atan2_hypot_f32

CODECS = [TqCodec("int4", 4), *(TqCodec("polar", b) for b in range(2, 7))]


def engine_fwht(row: np.ndarray) -> np.ndarray:
    """The engine's in-place loop, one f32 scalar at a time."""
    a = [np.float32(v) for v in row]
    n = len(a)
    length = 1
    while length < n:
        for i in range(0, n, 2 * length):
            for j in range(i, i + length):
                u, v = a[j], a[j + length]
                a[j], a[j + length] = np.float32(u + v), np.float32(u - v)
        length *= 2
    inv = np.float32(1.0) / np.sqrt(np.float32(n))
    return np.array([v * inv for v in a], np.float32)


@pytest.mark.parametrize("n,count", [(2, 4), (8, 4), (64, 4), (128, 3), (8, 40), (64, 33)])
def test_fwht_is_the_engine_loop_bitwise(n: int, count: int) -> None:
    """Few rows run in place, many rows transposed: both are the engine's loop, bit for bit."""
    rows = np.random.default_rng(n).standard_normal((count, n)).astype(np.float32) * 7
    got = fwht(rows)
    for r in range(count):
        assert np.array_equal(got[r], engine_fwht(rows[r]))
    assert np.array_equal(fwht(rows.reshape(1, count, n))[0], got)


def test_nearest_level_shortcut_is_the_scan() -> None:
    from kernels.tq.int4 import LEVELS, nearest_levels, scan_levels

    mid = (LEVELS[1:] + LEVELS[:-1]) / 2
    z = np.concatenate([np.random.default_rng(4).standard_normal(200_000).astype(np.float32) * 4, LEVELS, mid,
                        np.nextafter(mid, np.float32(9)), np.nextafter(mid, np.float32(-9)),
                        np.array([np.inf, -np.inf, np.nan, 1e30, -1e30, 1e4, -2e4, 0.0, -0.0], np.float32)])
    assert np.array_equal(nearest_levels(z.astype(np.float32)), scan_levels(z.astype(np.float32)))


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64, 128, 256, 512])
def test_fwht_self_inverse_and_orthonormal(n: int) -> None:
    rng = np.random.default_rng(n)
    x = rng.standard_normal((5, n)).astype(np.float32)
    assert np.abs(fwht(fwht(x)) - x).max() <= 1e-5 * np.abs(x).max()
    assert np.abs(unrotate(rotate(x)) - x).max() <= 1e-5 * np.abs(x).max()
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    assert np.allclose(fwht(x), x.astype(np.float64) @ h / np.sqrt(n), atol=1e-5)
    assert np.allclose(rotate(x), (x * SIGNS[:n]).astype(np.float64) @ h / np.sqrt(n), atol=1e-5)
    if n in (4, 16, 64, 256):  # 1/sqrt(n) is a power of two: small integers come back exactly
        ints = rng.integers(-50, 50, (5, n)).astype(np.float32)
        assert np.array_equal(fwht(fwht(ints)), ints)


def mean_rel_err(codec: TqCodec, x: np.ndarray) -> float:
    codes, radius = codec.encode_rows(x)
    dec = codec.decode_rows(codes, radius, x.shape[-1])
    return float(np.mean(np.linalg.norm(dec - x, axis=1) / np.linalg.norm(x, axis=1)))


@pytest.mark.parametrize("n", [512, 64])
def test_engine_quality_bounds(n: int) -> None:
    x = np.random.default_rng(5).standard_normal((400, n)).astype(np.float32)
    e_int4 = mean_rel_err(TqCodec("int4", 4), x)
    e_p3 = mean_rel_err(TqCodec("polar", 3), x)
    e_p4 = mean_rel_err(TqCodec("polar", 4), x)
    assert e_p4 < e_p3 and e_p4 < 0.45 and e_p3 < 0.65 and e_int4 < e_p4
    errs = [mean_rel_err(TqCodec("polar", b), x) for b in range(2, 7)]
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False))  # more bits, less error
    assert 0.05 < e_int4 < 0.15  # the engine's "about 0.10"


def test_the_encode_atan2_hypot_are_libm() -> None:
    """Byte-exact PolarQuant encode needs the C library's atan2f/hypotf: the encode's kernel gives
    exactly ctypes' libm on inputs over a wide range of magnitudes, signs, zeros and non-finite
    values (numpy's own f32 arctan2 does not on AVX-512 machines, so it is not used)."""
    name = ctypes.util.find_library("m")
    if name is None:
        pytest.skip("no C math library to compare with")
    lib = ctypes.CDLL(name)
    for fn in (lib.atan2f, lib.hypotf):
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    rng = np.random.default_rng(9)
    a, b = (rng.standard_normal((2, 3010)) * np.exp(rng.uniform(-5, 5, (2, 3010)))).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3e38], np.float32)
    a = np.concatenate([a, np.repeat(special, special.size)])  # every pair of specials
    b = np.concatenate([b, np.tile(special, special.size)])
    at = np.array([lib.atan2f(float(y), float(x)) for x, y in zip(a, b, strict=True)], np.float32)
    hy = np.array([lib.hypotf(float(x), float(y)) for x, y in zip(a, b, strict=True)], np.float32)
    ys, xs = b.reshape(7, -1), a.reshape(7, -1)  # [R, count] blocks, as the encode pairs them
    angle, radius = atan2_hypot_f32(ys, xs)
    assert angle.view(np.uint32).tolist() == at.view(np.uint32).reshape(7, -1).tolist()
    assert radius.view(np.uint32).tolist() == hy.view(np.uint32).reshape(7, -1).tolist()
    strided = np.stack([a, b], axis=1).reshape(7, -1)  # interleaved pairs, read through strided views
    angle2, radius2 = atan2_hypot_f32(strided[:, 1::2], strided[:, 0::2])
    assert np.array_equal(angle2.view(np.uint32), at.view(np.uint32).reshape(7, -1))
    assert np.array_equal(radius2.view(np.uint32), hy.view(np.uint32).reshape(7, -1))


widths = st.sampled_from([2, 4, 8, 16, 32, 64, 128, 512])


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CODECS), widths, st.integers(1, 6), st.integers(0, 2**32 - 1), st.floats(-30, 30))
def test_encode_decode_random_rows(codec: TqCodec, n: int, rows: int, seed: int, log_gain: float) -> None:
    x = (np.random.default_rng(seed).standard_normal((rows, n)) * np.exp(log_gain)).astype(np.float32)
    codes, radius = codec.encode_rows(x)
    assert codes.shape == (rows, codec.row_bytes(n)) and radius.dtype == np.float32
    dec = codec.decode_rows(codes, radius, n)
    assert dec.shape == x.shape and np.isfinite(dec).all()
    live = radius > 0
    assert np.array_equal(live, np.linalg.norm(x.astype(np.float64), axis=1) >= 1e-35)
    rel = np.linalg.norm(dec - x, axis=1)[live] / radius[live]
    assert np.all(rel <= 1.5)  # coarse (n=2 with 2 bits is very lossy) but bounded
    again, _ = codec.encode_rows(x)
    assert np.array_equal(again, codes)  # deterministic


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(CODECS), hnp.arrays(np.uint8, st.tuples(st.integers(0, 4), st.integers(0, 300))),
       st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=0, max_size=4),
       st.one_of(st.none(), st.integers(-3, 1100)))
def test_garbage_decodes_or_raises_our_error(codec: TqCodec, codes: np.ndarray, radius: list[float],
                                             width: int | None) -> None:
    r = np.array(radius, np.float32)
    try:
        out = codec.decode_rows(codes, r, width)
    except ColiError:
        return
    assert out.shape[:-1] == codes.shape[:-1] and out.dtype == np.float32
    assert np.all(out[~((r >= 0) & (r < np.float32(3.4e38)))] == 0)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CODECS), hnp.arrays(hnp.floating_dtypes() | hnp.integer_dtypes(),
                                           hnp.array_shapes(min_dims=0, max_dims=3, max_side=9)))
def test_garbage_encodes_or_raises_our_error(codec: TqCodec, x: np.ndarray) -> None:
    try:
        codes, radius = codec.encode_rows(x)
    except ColiError:
        return
    assert codes.shape[:-1] == radius.shape == x.shape[:-1]
    assert np.all(codes[~(radius > 0)] == 0)
