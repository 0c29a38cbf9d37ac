"""The two v3 row codecs behind one frozen value: ``TqCodec(kind, bits)`` (facts 4, 4.2, 4.3).

A v3 row of width n is ``row_bytes(n)`` code bytes plus one f32 radius (the L2 norm of the
original row). Writing: a row that is zero, holds a NaN or an Inf, or whose radius is not a finite
f32 >= 1e-35, is inert: radius 0 and all-zero bytes. Reading: a radius outside [0, 3.4e38)
(NaN included) makes the row inert, and an inert row decodes to zeros.
Rows are processed in blocks of about 64k elements, so temporaries stay small for any batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from kernels.errors import FormatError
from kernels.tq import int4, polar
from kernels.tq.rotation import WIDTHS, check_width, row_radius, unrotate

__all__ = ["INT4_TAG", "KV_DTYPES_V3", "RADIUS_MIN", "RADIUS_BOUND", "TqCodec", "usable_radius"]

INT4_TAG = 0x104  # (codec 1 << 8) | 4 bits
RADIUS_MIN = np.float32(1e-35)  # a written row needs radius >= this, else it is inert
RADIUS_BOUND = np.float32(3.4e38)  # a stored radius is usable only in [0, this)
KV_DTYPES_V3: tuple[str, ...] = ("int4", "polar2", "polar3", "polar4", "polar5", "polar6")
_BLOCK_ELEMS = 1 << 16


def usable_radius(radius: np.ndarray) -> np.ndarray:
    """The reading rule's mask: 0 <= radius < 3.4e38 (NaN fails). radius: [..] f32 -> [..] bool."""
    r = np.asarray(radius)
    return (r >= 0) & (r < RADIUS_BOUND)


@dataclass(frozen=True)
class TqCodec:
    """A v3 row codec: ``kind`` "int4" (bits 4, tag 0x104) or "polar" (bits 2..6, tag = bits)."""

    kind: Literal["int4", "polar"]
    bits: int

    def __post_init__(self) -> None:
        if self.kind == "int4":
            if self.bits != 4:
                raise FormatError(f"v3 codec: rotated int4 has 4 bits, found {self.bits!r}")
        elif self.kind == "polar":
            if not isinstance(self.bits, int) or self.bits not in range(2, 7):
                raise FormatError(f"v3 codec: PolarQuant bits must be 2..6, found {self.bits!r}")
        else:
            raise FormatError(f"v3 codec: kind must be 'int4' or 'polar', found {self.kind!r}")

    @classmethod
    def from_tag(cls, tag: int) -> TqCodec:
        """The codec of a v3 header's format tag h[7] = (codec << 8) | bits."""
        if tag == INT4_TAG:
            return cls("int4", 4)
        if isinstance(tag, (int, np.integer)) and 2 <= int(tag) <= 6:
            return cls("polar", int(tag))
        raise FormatError(f"v3 format tag {tag!r} (0x{int(tag) & 0xFFFFFFFF:x}) is neither 0x104 (int4) nor 2..6 "
                          "(PolarQuant bits)")

    @classmethod
    def from_kv_dtype(cls, name: str) -> TqCodec:
        """"int4" or "polar2".."polar6" -> the codec."""
        if name == "int4":
            return cls("int4", 4)
        if name in KV_DTYPES_V3:
            return cls("polar", int(name[len("polar"):]))
        raise FormatError(f"v3 kv dtype {name!r} is not one of {', '.join(KV_DTYPES_V3)}")

    @property
    def tag(self) -> int:
        return INT4_TAG if self.kind == "int4" else self.bits

    @property
    def kv_dtype(self) -> str:
        return "int4" if self.kind == "int4" else f"polar{self.bits}"

    def row_bytes(self, n: int) -> int:
        """Code bytes of one row of width n (a power of two in 2..512)."""
        return check_width(n) // 2 if self.kind == "int4" else polar.polar_row_bytes(n, self.bits)

    def width_of(self, row_bytes: int) -> int:
        """The row width whose rows take ``row_bytes`` code bytes (refused when none or several do:
        PolarQuant rows of widths 2 and 4 can take the same bytes)."""
        found = [n for n in WIDTHS if self.row_bytes(n) == row_bytes]
        if len(found) != 1:
            what = "no row size" if not found else f"the row size of widths {found}: give the width"
            raise FormatError(f"v3 codec {self.kv_dtype}: {row_bytes!r} bytes is {what}")
        return found[0]

    def row_scale(self, radius: np.ndarray, n: int) -> np.ndarray:
        """The per-row factor hoisted out of attention dot products, 0.0 for inert rows: [R] f32.

        int4: radius / sqrtf(n) (the engine's std); PolarQuant: the radius itself.
        """
        r = np.asarray(radius, np.float32)  # r: [R] f32
        r = np.where(usable_radius(r), r, np.float32(0.0)).astype(np.float32)
        return int4.int4_std(r, n) if self.kind == "int4" else r

    def encode_rows(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x [..., n] floats (taken as f32) -> (codes [..., row_bytes(n)] u8, radius [...] f32), engine bytes."""
        arr = np.asarray(x)
        if arr.dtype.kind != "f" or arr.ndim < 1:
            raise FormatError(f"v3 encode: expected a float array [..., n], found {arr.dtype} {arr.shape}")
        n = check_width(int(arr.shape[-1]))
        lead = arr.shape[:-1]
        rows = arr.reshape(-1, n)  # rows: [R, n]
        codes = np.zeros((rows.shape[0], self.row_bytes(n)), np.uint8)  # codes: [R, rb] u8
        radius = np.zeros(rows.shape[0], np.float32)  # radius: [R] f32
        step = max(1, _BLOCK_ELEMS // n)
        for a in range(0, rows.shape[0], step):
            with np.errstate(over="ignore"):  # a value beyond f32 becomes inf: an inert row
                blk = np.asarray(rows[a : a + step], dtype=np.float32)  # blk: [r, n] f32
            rad = row_radius(blk)  # rad: [r] f32
            live = np.isfinite(rad) & (rad >= RADIUS_MIN)  # live: [r] bool (an Inf/NaN element makes rad non-finite)
            if not live.any():
                continue
            sel = np.flatnonzero(live) + a  # sel: [k] i64 rows that encode
            radius[sel] = rad[live]
            if self.kind == "int4":
                codes[sel] = int4.encode_rotated(blk[live], rad[live])
            else:
                codes[sel] = polar.encode_rotated(blk[live], polar.polar_layout(n, self.bits))
        return codes.reshape(*lead, codes.shape[-1]), radius.reshape(lead)

    def rotated_order(self, n: int) -> np.ndarray | None:
        """The element order of ``decode_rotated_into``'s columns (out[:, p] holds rotated element
        order[p]): None for int4 (element order); PolarQuant: bit-reversed, its decode's natural order."""
        return None if self.kind == "int4" else polar.polar_layout(check_width(n), self.bits).order

    def decode_rotated_into(self, codes: np.ndarray, out: np.ndarray) -> None:
        """Unit-scale values in the ROTATED domain: codes [R, rb] u8 -> out [R, n] f32 (C order, aligned),
        columns in ``rotated_order(n)``.

        int4: LEVELS[code]; PolarQuant: the angle tree from cur[0] = 1. Multiplied by
        ``row_scale(radius)``, put in element order and unrotated they give the decoded rows (to f32
        rounding).
        """
        n = int(out.shape[1])
        if self.kind == "int4":
            int4.decode_levels_into(codes, out)
        else:
            ones = np.ones(codes.shape[0], np.float32)  # ones: [R] f32
            polar.decode_unit_into(codes, polar.polar_layout(n, self.bits), ones, out, stored_order=True)

    def decode_rows(self, codes: np.ndarray, radius: np.ndarray, width: int | None = None) -> np.ndarray:
        """(codes [..., rb] u8, radius [...] f32) -> rows [..., n] f32, as the engine decodes them.

        ``width`` (n) is found from rb when omitted (and refused where rb fits two widths)."""
        c = np.asarray(codes)
        r = np.asarray(radius)
        if c.dtype != np.uint8 or c.ndim < 1:
            raise FormatError(f"v3 decode: codes must be a u8 array [..., row_bytes], found {c.dtype} {c.shape}")
        if r.shape != c.shape[:-1] or r.dtype.kind != "f":
            raise FormatError(f"v3 decode: radius must be float {c.shape[:-1]}, found {r.dtype} {r.shape}")
        n = self.width_of(int(c.shape[-1])) if width is None else check_width(width)
        if c.shape[-1] != self.row_bytes(n):
            raise FormatError(f"v3 decode: {self.kv_dtype} rows of width {n} take {self.row_bytes(n)} bytes, "
                              f"found {c.shape[-1]}")
        lead = c.shape[:-1]
        c2 = c.reshape(-1, c.shape[-1])  # c2: [R, rb] u8
        r2 = r.reshape(-1).astype(np.float32)  # r2: [R] f32
        out = np.zeros((c2.shape[0], n), np.float32)  # out: [R, n] f32
        step = max(1, _BLOCK_ELEMS // n)
        for a in range(0, c2.shape[0], step):
            self.decode_block_into(c2[a : a + step], r2[a : a + step], out[a : a + step])
        return out.reshape(*lead, n)

    def decode_block_into(self, codes: np.ndarray, radius: np.ndarray, out: np.ndarray) -> None:
        """The engine's decode of rows: codes [R, rb] u8, radius [R] f32 -> out [R, n] f32 (C order)."""
        n = int(out.shape[1])
        ok = usable_radius(radius)  # ok: [R] bool (the reading rule)
        rad = np.where(ok, radius, np.float32(0.0)).astype(np.float32)  # rad: [R] f32
        rot = np.empty_like(out)  # rot: [R, n] f32 rotated-domain values
        if self.kind == "int4":
            int4.decode_levels_into(codes, rot)
            rot *= int4.int4_std(rad, n)[:, None]  # lev[code] * std, as the engine multiplies
        else:
            polar.decode_unit_into(codes, polar.polar_layout(n, self.bits), rad, rot)
        out[...] = unrotate(rot)
        out[~ok | (rad == 0)] = 0.0  # inert rows are exact zeros
