"""v3 codecs: the engine's known-answer vectors (facts 4.4), tags, row sizes, inert rows, errors."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kernels.errors import FormatError
from kernels.tq import INT4_TAG, SIGNS, TqCodec, rotate, row_radius, sign_hash

INT4 = TqCodec("int4", 4)
POLAR4 = TqCodec("polar", 4)
KA_X = ((np.arange(64) - 31.5) / 8).astype(np.float32)  # x[i] = (i - 31.5) / 8, n = 64
KA_INT4 = "da7379e6c793982e9316dc76d69b96ba6145ba58b74b58dae896a7c3e985ba6c"
KA_POLAR4 = "0bc7fc6a3f1a8cae204a5ca4ebdcfb7a3b5fa8521d87ec246edc360a"


def f32(*vals: str) -> np.ndarray:
    return np.array([np.float32(v) for v in vals], np.float32)


def test_sign_hash_and_first_signs() -> None:
    assert int(sign_hash(np.array(0x9E3779B9, np.uint32))) == 0x3CD6E3F3
    assert "".join("-" if s < 0 else "+" for s in SIGNS[:16]) == "-+-+++-+++--+-++"
    assert set(np.unique(SIGNS)) == {-1.0, 1.0} and SIGNS.shape == (512,)


def test_known_answer_rotation_and_radius() -> None:
    assert np.array_equal(rotate(KA_X)[:4], f32("1.359375", "3.515625", "-3.203125", "-0.046875"))
    assert row_radius(KA_X).view(np.uint32) == 0x4193C89C


@pytest.mark.parametrize("codec,hexbytes,dec", [
    (INT4, KA_INT4, ("-4.02537203", "-4.07213211", "-3.83948803", "-3.90587521")),
    (POLAR4, KA_POLAR4, ("-3.88095903", "-3.61564231", "-3.17657208", "-4.16856432")),
])
def test_known_answer_bytes_and_decode(codec: TqCodec, hexbytes: str, dec: tuple[str, ...]) -> None:
    codes, radius = codec.encode_rows(KA_X)
    assert codes.dtype == np.uint8 and codes.shape == (codec.row_bytes(64),)
    assert codes.tobytes().hex() == hexbytes
    assert radius.view(np.uint32) == 0x4193C89C
    out = codec.decode_rows(np.frombuffer(bytes.fromhex(hexbytes), np.uint8), radius)
    assert np.array_equal(out[:4], f32(*dec))


def test_tags_and_kv_dtypes() -> None:
    assert INT4.tag == INT4_TAG == 0x104
    for bits in range(2, 7):
        c = TqCodec("polar", bits)
        assert c.tag == bits and TqCodec.from_tag(bits) == c and TqCodec.from_kv_dtype(f"polar{bits}") == c
        assert c.kv_dtype == f"polar{bits}"
    assert TqCodec.from_tag(0x104) == INT4 == TqCodec.from_kv_dtype("int4")
    for bad in (0, 1, 7, 0x100, 0x103, 0x105, 0x204, -1, 1 << 40):
        with pytest.raises(FormatError, match="tag"):
            TqCodec.from_tag(bad)
    for name in ("fp8", "f32", "polar1", "polar7", "int8", ""):
        with pytest.raises(FormatError, match="kv dtype"):
            TqCodec.from_kv_dtype(name)
    with pytest.raises(FormatError):
        TqCodec("int4", 3)
    with pytest.raises(FormatError):
        TqCodec("polar", 7)
    with pytest.raises(FormatError):
        TqCodec("fp4", 4)  # type: ignore[arg-type]


def test_row_bytes_figures() -> None:
    assert POLAR4.row_bytes(512) == 224 and POLAR4.row_bytes(64) == 28
    assert INT4.row_bytes(512) == 256 and INT4.row_bytes(64) == 32

    def per_token(c: TqCodec, layers: int = 78, kv: int = 512, rope: int = 64) -> int:
        return 4 + layers * (c.row_bytes(kv) + 4 + c.row_bytes(rope) + 4)

    assert per_token(INT4) == 23_092
    assert [per_token(TqCodec("polar", b)) for b in range(2, 7)] == [9_052, 14_668, 20_284, 25_900, 31_516]
    for c in (INT4, *(TqCodec("polar", b) for b in range(2, 7))):
        for n in (8, 16, 32, 64, 128, 256, 512):
            assert c.width_of(c.row_bytes(n)) == n
    assert TqCodec("polar", 2).row_bytes(2) == TqCodec("polar", 2).row_bytes(4) == 1
    with pytest.raises(FormatError, match="give the width"):
        TqCodec("polar", 2).width_of(1)


@pytest.mark.parametrize("n", [0, 1, 3, 6, 48, 576, 1024, -2])
def test_widths_other_than_powers_of_two_are_refused(n: int) -> None:
    with pytest.raises(FormatError, match="power of two"):
        INT4.row_bytes(n)
    if n > 0:
        with pytest.raises(FormatError, match="power of two"):
            POLAR4.encode_rows(np.ones((2, n), np.float32))


@pytest.mark.parametrize("codec", [INT4, POLAR4, TqCodec("polar", 2), TqCodec("polar", 6)])
def test_inert_rows_on_write(codec: TqCodec) -> None:
    n = 64
    rows = np.random.default_rng(0).standard_normal((7, n)).astype(np.float32)
    rows[0] = 0.0
    rows[1, 5] = np.nan
    rows[2, 9] = np.inf
    rows[3, 0] = -np.inf
    rows[4] = 1e-37  # radius 8e-37 < 1e-35
    rows[5] = np.float32(3e38)  # finite values, norm overflows f32
    rows[6] = 2e-36  # radius 1.6e-35 >= 1e-35: a live row
    codes, radius = codec.encode_rows(rows)
    assert np.all(codes[:6] == 0) and np.all(radius[:6] == 0)
    assert radius[6] > 0 and codes[6].any()
    out = codec.decode_rows(codes, radius)
    assert np.all(out[:6] == 0) and not np.signbit(out[:6]).any()
    assert np.allclose(out[6], rows[6], rtol=0, atol=0.5 * 2e-36 * 4)


@pytest.mark.parametrize("codec", [INT4, POLAR4])
def test_reading_rule_radius_out_of_range_is_inert(codec: TqCodec) -> None:
    rows = np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32)
    codes, radius = codec.encode_rows(rows)
    bad = radius.copy()
    bad[:6] = [np.nan, -1.0, -np.inf, np.inf, np.float32(3.4e38), np.float32(3.402e38)]
    bad[6] = np.nextafter(np.float32(3.4e38), np.float32(0))  # the largest usable radius
    out = codec.decode_rows(codes, bad)
    assert np.all(out[:6] == 0)
    assert np.any(out[6] != 0)  # huge (it may overflow f32 in the rotation, as in the engine), not inert
    assert np.array_equal(out[7], codec.decode_rows(codes[7], radius[7]))
    assert np.array_equal(codec.row_scale(bad, 32)[:6], np.zeros(6, np.float32))


def test_radius_is_the_sequential_double_sum() -> None:
    rng = np.random.default_rng(2)
    rows = (rng.standard_normal((50, 512)) * np.exp(rng.uniform(-20, 20, (50, 512)))).astype(np.float32)
    for row, got in zip(rows, row_radius(rows), strict=True):
        ss = 0.0
        for v in row:
            ss += float(v) * float(v)
        assert got == np.float32(math.sqrt(ss))


def test_bad_inputs_raise_format_error() -> None:
    with pytest.raises(FormatError):
        INT4.encode_rows(np.ones((2, 64), np.int32))
    with pytest.raises(FormatError):
        INT4.encode_rows(np.array(1.0, np.float32))
    with pytest.raises(FormatError):
        INT4.decode_rows(np.zeros((2, 32), np.int16), np.ones(2, np.float32))
    with pytest.raises(FormatError):
        INT4.decode_rows(np.zeros((2, 32), np.uint8), np.ones(3, np.float32))
    with pytest.raises(FormatError, match="row size"):
        POLAR4.decode_rows(np.zeros((2, 29), np.uint8), np.ones(2, np.float32))


def test_batch_shapes_and_blocks_agree_with_single_rows() -> None:
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((3, 700, 16)).astype(np.float32)  # more rows than one internal block
    for codec in (INT4, TqCodec("polar", 3)):
        codes, radius = codec.encode_rows(rows)
        assert codes.shape == (3, 700, codec.row_bytes(16)) and radius.shape == (3, 700)
        one_c, one_r = codec.encode_rows(rows[2, 699])
        assert np.array_equal(one_c, codes[2, 699]) and one_r == radius[2, 699]
        dec = codec.decode_rows(codes, radius)
        assert dec.shape == rows.shape and np.array_equal(dec[1, 5], codec.decode_rows(codes[1, 5], radius[1, 5]))


@pytest.mark.parametrize("codec", [INT4, POLAR4, TqCodec("polar", 2), TqCodec("polar", 5)], ids=lambda c: c.kv_dtype)
@pytest.mark.parametrize("n", [2, 16, 512])
def test_rotated_decode_is_the_decode_before_scale_and_unrotation(codec: TqCodec, n: int) -> None:
    """decode_rotated_into (columns in rotated_order) * row_scale, put in element order and unrotated,
    is decode_rows to f32 rounding; PolarQuant's stored order is an exact permutation of its decode."""
    from kernels.tq import unrotate
    from kernels.tq.polar import decode_unit_into, polar_layout

    x = np.random.default_rng(n).standard_normal((40, n)).astype(np.float32)
    codes, radius = codec.encode_rows(x)
    unit = np.empty((40, n), np.float32)
    codec.decode_rotated_into(codes, unit)
    order = codec.rotated_order(n)
    elems = unit.copy()
    if order is not None:
        elems[:, order] = unit
    got = unrotate(elems * codec.row_scale(radius, n)[:, None])
    want = codec.decode_rows(codes, radius, n)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    if codec.kind == "polar":
        assert order is not None and sorted(order.tolist()) == list(range(n))
        layout = polar_layout(n, codec.bits)
        a, b = np.empty((40, n), np.float32), np.empty((40, n), np.float32)
        decode_unit_into(codes, layout, radius, a, stored_order=True)
        decode_unit_into(codes, layout, radius, b)
        assert np.array_equal(a, b[:, order])
    else:
        assert order is None
