"""The compiled step's v3 row kernels (kernels.model.tq_row_tables) against the codec itself
(kernels.tq.TqCodec): every row's codes and radius, and every decoded row, bitwise, for int4 and
PolarQuant at several widths, including the rows the model tests never make: zero, NaN, Inf and
tiny rows (inert when written), and stored radii the reading rule refuses (negative, NaN, Inf,
from 3.4e38)."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.model.tq_row_tables import codec_params, decode_tq_row, encode_tq_rows
from kernels.tq import TqCodec


def _rows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((24, n)) * rng.choice([1e-3, 1.0, 300.0], (24, 1))).astype(np.float32)  # [24, n] f32
    x[3] = 0.0
    x[4, 1] = np.nan
    x[5, 0] = np.inf
    x[6] = np.float32(1e-38)  # radius below RADIUS_MIN: inert
    x[7] = np.float32(3e38)  # radius past f32: inert
    return x


@pytest.mark.parametrize("kv_dtype", ["int4", "polar2", "polar5"])
@pytest.mark.parametrize("n", [8, 64])
def test_rows_encode_and_decode_as_the_codec_does(kv_dtype: str, n: int) -> None:
    codec = TqCodec.from_kv_dtype(kv_dtype)
    x = _rows(n, n)
    codes, radius = codec.encode_rows(x)  # [24, rb] u8, [24] f32
    p = codec_params(codec, n)
    got_codes = np.full(codes.shape, 255, np.uint8)
    got_radius = np.full(radius.shape, -1.0, np.float32)
    encode_tq_rows(x, p, got_codes, got_radius)
    assert np.array_equal(got_codes, codes)
    assert np.array_equal(got_radius.view(np.uint32), radius.view(np.uint32))
    stored = radius.copy()
    stored[8:12] = np.array([-1.0, np.nan, np.inf, 3.4e38], np.float32)  # the reading rule: inert rows
    want = codec.decode_rows(codes, stored, n)  # [24, n] f32
    got = np.full((24, n), 7.0, np.float32)
    for i in range(24):
        decode_tq_row(codes[i], stored[i], p, got[i], np.empty(n, np.float32), np.empty(n, np.float32))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not got[8:12].any() and got[12].any()
