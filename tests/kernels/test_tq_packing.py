"""v3 bit packing, exhaustively: every int4 code at every nibble position, every PolarQuant code
value at every field (bit offset) for bits 2..6 and several widths, against the byte rules of
facts 4.2 / 4.3 written out bit by bit here."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.tq import TqCodec
from kernels.tq.packing import FieldLayout, pack_fields, pack_nibbles, unpack_fields, unpack_nibbles
from kernels.tq.polar import polar_layout


@pytest.mark.parametrize("n", [2, 8, 64, 512])
def test_every_nibble_code_at_every_position(n: int) -> None:
    grid_pos, grid_code = np.meshgrid(np.arange(n), np.arange(16), indexing="ij")  # [n, 16] each
    pos, code = grid_pos.reshape(-1), grid_code.reshape(-1)
    codes = np.zeros((pos.size, n), np.uint8)  # one row per (position, code)
    codes[np.arange(pos.size), pos] = code
    want = np.zeros((pos.size, n // 2), np.uint8)
    want[np.arange(pos.size), pos >> 1] = code << ((pos & 1) * 4)  # byte[i >> 1] |= code << ((i & 1) * 4)
    packed = pack_nibbles(codes)
    assert np.array_equal(packed, want)
    assert np.array_equal(unpack_nibbles(packed), codes)


def spec_widths(n: int, bits: int) -> list[int]:
    """Field widths in stream order: n/2 level-1 angles of b bits, then n/2 - 1 of max(b - 1, 1)."""
    return [bits] * (n // 2) + [max(bits - 1, 1)] * (n // 2 - 1)


def spec_pack(fields: np.ndarray, widths: list[int]) -> np.ndarray:
    """The LSB-first rule, bit by bit: bit k of a field at cursor pos -> byte (pos+k)>>3, bit (pos+k)&7."""
    total = sum(widths)
    out = np.zeros((fields.shape[0], (total + 7) // 8), np.uint8)
    pos = 0
    for j, w in enumerate(widths):
        for k in range(w):
            bit = ((fields[:, j].astype(np.int64) >> k) & 1).astype(np.uint8)
            out[:, (pos + k) >> 3] |= bit << ((pos + k) & 7)
        pos += w
    return out


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("n", [2, 4, 8, 32, 64])
def test_every_polar_code_value_at_every_field(n: int, bits: int) -> None:
    widths = spec_widths(n, bits)
    layout = polar_layout(n, bits).fields
    assert layout.nbytes == TqCodec("polar", bits).row_bytes(n)
    rows = []
    for j, w in enumerate(widths):  # one row per (field, value): that field set, all others 0
        block = np.zeros((1 << w, len(widths)), np.uint16)
        block[:, j] = np.arange(1 << w)
        rows.append(block)
    fields = np.concatenate(rows)  # [sum 2^w, n - 1] u16
    packed = pack_fields(fields, layout)
    assert np.array_equal(packed, spec_pack(fields, widths))
    assert np.array_equal(unpack_fields(packed, layout), fields)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("n", [16, 128, 512])
def test_random_full_rows_round_trip_and_pad_bits_stay_zero(n: int, bits: int) -> None:
    rng = np.random.default_rng(n * 10 + bits)
    widths = spec_widths(n, bits)
    layout = FieldLayout(widths)
    fields = (rng.integers(0, 1 << 16, (40, n - 1)) & ((1 << np.array(widths)) - 1)).astype(np.uint16)
    packed = pack_fields(fields, layout)
    assert np.array_equal(packed, spec_pack(fields, widths))
    assert np.array_equal(unpack_fields(packed, layout), fields)
    pad = layout.nbytes * 8 - layout.total_bits
    if pad:
        assert not np.any(packed[:, -1] >> (8 - pad))
    # rows that arrive as strided views (a record array) unpack the same
    wide = np.zeros((40, layout.nbytes + 9), np.uint8)
    wide[:, 3 : 3 + layout.nbytes] = packed
    assert np.array_equal(unpack_fields(wide[:, 3 : 3 + layout.nbytes], layout), fields)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_codec_bytes_follow_the_stream_layout(bits: int) -> None:
    """The codes the encoder writes read back field by field (level 1 first) with the spec layout."""
    n = 64
    codec = TqCodec("polar", bits)
    x = np.random.default_rng(bits).standard_normal((30, n)).astype(np.float32)
    codes, _ = codec.encode_rows(x)
    fields = unpack_fields(codes, FieldLayout(spec_widths(n, bits)))
    assert np.array_equal(spec_pack(fields, spec_widths(n, bits)), codes)
    assert int(fields[:, : n // 2].max()) == (1 << bits) - 1  # level 1 uses the full b-bit range


def test_bad_layouts_and_shapes_are_refused() -> None:
    from kernels.errors import FormatError

    with pytest.raises(FormatError):
        FieldLayout([3, 9])
    with pytest.raises(FormatError):
        FieldLayout([0])
    layout = FieldLayout([4, 4])
    with pytest.raises(FormatError):
        pack_fields(np.zeros((2, 3), np.uint16), layout)
    with pytest.raises(FormatError):
        unpack_fields(np.zeros((2, 2), np.uint8), layout)
    with pytest.raises(FormatError):
        pack_nibbles(np.zeros((2, 3), np.uint8))
