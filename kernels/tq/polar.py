"""Codec 0 of v3 rows: PolarQuant with b = 2..6 bits (facts 4.3), over blocks of rows.

Encode: r = rotate(x); while the length is > 1, pair (r[2j], r[2j+1]) into the angle
``atan2f(r[2j+1], r[2j])`` and the new r[j] = ``hypotf(r[2j], r[2j+1])``: n - 1 angles, level by
level, j order within a level. Level 1 angles (n/2 of them) use b bits on a uniform grid over
(-pi, pi]; deeper levels use max(b - 1, 1) bits on [lo, lo + 2 hw] with hw(l) = min(1.5 / sqrtf(2^(l-1)),
pi/4), lo = pi/4 - hw. The codes are packed LSB-first (kernels.tq.packing).
Decode: top-down from cur[0] = radius, nxt[2j] = cur[j] cosf(a), nxt[2j+1] = cur[j] sinf(a), then
unrotate. A ``PolarLayout`` holds, per (n, b), the field layout (and the order decoding reads it
in) and tables of cosf and sinf for every code of every level, so rows decode with one unpack,
two lookups, and two multiplies per level.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kernels.errors import FormatError
from kernels.tq.libm import cos_sin_f32
from kernels.tq.packing import FieldLayout, pack_fields, unpack_fields_t
from kernels.tq.rotation import check_width, rotate

__all__ = ["PI", "PolarLayout", "decode_unit_into", "encode_rotated", "polar_layout", "polar_row_bytes"]

PI = np.float32(3.14159265358979323846)
_QUARTER = PI / np.float32(4.0)
_HALF = np.float32(0.5)


def polar_row_bytes(n: int, bits: int) -> int:
    """((n/2) b + (n/2 - 1) max(b - 1, 1) + 7) // 8 bytes (n=512, b=4: 224; n=64, b=4: 28)."""
    half = check_width(n) // 2
    return (half * bits + (half - 1) * max(bits - 1, 1) + 7) // 8


@dataclass(frozen=True)
class Level:
    """Level l of the angle tree: ``count`` angles of ``width`` bits, fields [start, start + count)."""

    index: int
    count: int
    width: int
    start: int
    lo: np.float32  # grid start: -pi on level 1, pi/4 - hw deeper
    span: np.float32  # grid width: 2 pi on level 1, 2 hw deeper

    def quantize(self, ang: np.ndarray) -> np.ndarray:
        """Angles [R, count] f32 -> codes [R, count] u16 (floor, clamped; NaN -> 0)."""
        steps = np.float32(1 << self.width)
        if self.index == 1:
            t = ((ang + PI) * (_HALF / PI)) * steps  # t: [R, count] f32
        else:
            t = ((ang - self.lo) / self.span) * steps
        t = np.floor(t)
        t = np.where(t >= 0, t, np.float32(0))  # NaN and negatives -> 0
        np.minimum(t, steps - 1, out=t)
        return t.astype(np.uint16)

    def angles(self) -> np.ndarray:
        """The decoded angle of every code: [2^width] f32 (lo + (q + 0.5) * span / 2^width)."""
        q = np.arange(1 << self.width, dtype=np.float32)  # q: [2^w] f32
        return (self.lo + ((q + _HALF) * self.span) / np.float32(1 << self.width)).astype(np.float32)


class PolarLayout:
    """Levels, packed field layout and the cosf / sinf decode tables of one (n, bits)."""

    def __init__(self, n: int, bits: int) -> None:
        if bits not in range(2, 7):
            raise FormatError(f"v3 codec: PolarQuant bits must be 2..6, found {bits!r}")
        self.n = check_width(n)
        self.bits = bits
        levels: list[Level] = []
        start, count, index = 0, self.n // 2, 1
        while count >= 1:
            width = bits if index == 1 else max(bits - 1, 1)
            if index == 1:
                lo, span = -PI, np.float32(2.0) * PI
            else:
                hw = min(np.float32(1.5) / np.sqrt(np.float32(1 << (index - 1))), _QUARTER)
                lo, span = np.float32(_QUARTER - hw), np.float32(2.0) * np.float32(hw)
            levels.append(Level(index, count, width, start, lo, span))
            start += count
            count //= 2
            index += 1
        self.levels = tuple(levels)
        self.fields = FieldLayout([lv.width for lv in levels for _ in range(lv.count)])
        assert self.fields.nbytes == polar_row_bytes(n, bits)
        bases, tables = [], []
        base = 0
        for lv in levels:
            bases.append(np.full(lv.count, base, np.uint16))
            tables.append(lv.angles())
            base += 1 << lv.width
        self.cos_table, self.sin_table = cos_sin_f32(np.concatenate(tables))  # [K = sum 2^w] f32 each
        self.field_base = np.concatenate(bases)  # field_base: [n-1] u16 table offset of each field
        # Decoding stores each level's values bit-reversed (element i of a length-m level at rev_m(i)),
        # so every multiply of the tree writes two contiguous blocks: nxt = [cur * cos, cur * sin].
        self.order = bit_reversal(self.n)  # order: [n] i64, storage position p holds element order[p]
        read = np.concatenate([lv.start + bit_reversal(lv.count) for lv in levels])  # read: [n-1] i64
        self.read_fields = self.fields.reordered(read)
        self.read_base = self.field_base[read]  # read_base: [n-1] u16

    @property
    def row_bytes(self) -> int:
        return self.fields.nbytes


def bit_reversal(m: int) -> np.ndarray:
    """[m] i64: i with its log2(m) bits reversed (m a power of two; an involution)."""
    bits = m.bit_length() - 1
    i = np.arange(m, dtype=np.int64)
    out = np.zeros(m, np.int64)
    for k in range(bits):
        out |= ((i >> k) & 1) << (bits - 1 - k)
    return out


@lru_cache(maxsize=64)
def polar_layout(n: int, bits: int) -> PolarLayout:
    return PolarLayout(n, bits)


def encode_rotated(x: np.ndarray, layout: PolarLayout) -> np.ndarray:
    """x [R, n] f32 (usable rows) -> packed codes [R, row_bytes] u8."""
    from kernels.tq.libm_kernel import atan2_hypot_f32  # compiled: loaded by the first encode, not by a reader

    r = rotate(x)  # r: [R, n] f32
    codes = np.empty((x.shape[0], layout.n - 1), np.uint16)  # codes: [R, n-1] u16
    with np.errstate(invalid="ignore", over="ignore"):
        for lv in layout.levels:
            even, odd = r[:, 0::2], r[:, 1::2]  # [R, count] f32 views
            angle, r = atan2_hypot_f32(odd, even)  # libm's atan2f, hypotf: [R, count] f32 each
            codes[:, lv.start : lv.start + lv.count] = lv.quantize(angle)
    return pack_fields(codes, layout.fields)


def decode_unit_into(packed: np.ndarray, layout: PolarLayout, top: np.ndarray, out: np.ndarray, *,
                     stored_order: bool = False) -> None:
    """Top-down decode from cur[0] = ``top`` [R] f32 into ``out`` [R, n] f32 (the ROTATED domain).

    ``top`` is the radius for the engine's decode, or ones for values with the radius hoisted.
    The work runs on the transposed block (rows on the inner axis) with each level stored
    bit-reversed, so every multiply is one long contiguous loop; the products are the engine's,
    element by element. ``stored_order``: leave the values bit-reversed (out[:, p] holds element
    ``layout.order[p]``), as attention reads them; otherwise they are put back in element order.
    """
    rows = packed.shape[0]
    if rows == 0:
        return
    idx = unpack_fields_t(packed, layout.read_fields)  # idx: [n-1, R] u16, storage order within each level
    idx += layout.read_base[:, None]
    cos = np.take(layout.cos_table, idx)  # cos: [n-1, R] f32
    sin = np.take(layout.sin_table, idx)  # sin: [n-1, R] f32
    cur = np.asarray(top, np.float32).reshape(1, rows)  # cur: [1, R] f32
    for lv in reversed(layout.levels):
        m = lv.count
        nxt = np.empty((2 * m, rows), np.float32)  # nxt: [2m, R] f32
        np.multiply(cur, cos[lv.start : lv.start + m], out=nxt[:m])  # element 2j at storage rev(j)
        np.multiply(cur, sin[lv.start : lv.start + m], out=nxt[m:])  # element 2j + 1 at storage m + rev(j)
        cur = nxt
    out[...] = (cur if stored_order else np.take(cur, layout.order, axis=0)).T
