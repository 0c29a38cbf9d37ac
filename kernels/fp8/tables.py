"""The fp8 e4m3 lookup tables: decode (256 codes), encode (65,536 keys), decode by pairs.

Decode (FORMAT.md section 2): E=(b>>3)&15, M=b&7; E>0: (1+M/8)*2^(E-7), E=0: M*2^-9, sign bit 7;
the NaN codes 0x7F and 0xFF read as +0.0. Encode of one float32: NaN -> 0x00; |x| > 448 or inf ->
sign|0x7E; otherwise round half to even onto the e4m3 grid (subnormal step 2^-9), sign kept.

The encode table is indexed by the top 16 bits of the f32 pattern with bit 0 replaced by "bit 0 OR
any of the low 16 bits set". For every f32 the rounding position sits at mantissa bit 19 or higher,
so the low 17 bits only ever act as a sticky bit and that key decides the code exactly (ties too).
"""
from __future__ import annotations

import threading

import numpy as np


def _build_decode_table() -> np.ndarray:
    b = np.arange(256)
    exp, man = (b >> 3) & 15, b & 7
    mag = np.where(exp > 0, np.ldexp(1.0 + man / 8.0, exp - 7), np.ldexp(man.astype(np.float64), -9))
    val = np.where(b & 0x80, -mag, mag)  # [256] f64, exact
    val[(b & 0x7F) == 0x7F] = 0.0  # NaN codes read as +0.0 (the engine zeroes them on load)
    table = val.astype(np.float32)  # [256] f32
    table.flags.writeable = False
    return table


DECODE_TABLE: np.ndarray = _build_decode_table()  # [256] f32, read-only


def encode_reference(bits: np.ndarray) -> np.ndarray:
    """Integer-only encoder over raw float32 bit patterns (u32, any shape) -> u8 codes.

    Slow and direct; builds the lookup table and serves as a cross-check in tests.
    """
    u = np.asarray(bits, dtype=np.uint32).astype(np.int64)
    sign = (u >> 24) & 0x80
    e = (u >> 23) & 0xFF
    m = u & 0x7FFFFF
    sig = np.where(e > 0, m | (1 << 23), m)  # value = sig * 2^(unb - 23)
    unb = np.where(e > 0, e - 127, -126)
    grid = np.maximum(unb, -6)  # e4m3 exponent of the grid step 2^(grid-3)
    shift = np.minimum(20 + grid - unb, 25)  # low bits of sig below the grid step
    q = sig >> shift
    rem = sig & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1)))  # round half to even
    code = np.minimum(((grid + 6) << 3) + q, 0x7E) | sign  # carry into the exponent; saturate
    code = np.where((e == 255) & (m != 0), 0, code)  # NaN -> 0x00
    return code.astype(np.uint8)


def _build_encode_table() -> np.ndarray:
    keys = np.arange(1 << 16, dtype=np.uint32)  # [65536] u32: top 16 bits, bit 0 = sticky
    table = encode_reference(keys << 16)  # [65536] u8
    table.flags.writeable = False
    return table


ENCODE_TABLE: np.ndarray = _build_encode_table()  # [65536] u8, read-only: code by sticky key
_pair_lock = threading.Lock()
_pair: np.ndarray | None = None


def pair_table() -> np.ndarray:
    """[65536, 2] f32 read-only: row ``lo | hi << 8`` is ``(DECODE_TABLE[lo], DECODE_TABLE[hi])``.

    Decodes two codes at once through a little-endian uint16 view of a code row. Built lazily.
    """
    global _pair
    if _pair is None:
        with _pair_lock:
            if _pair is None:
                idx = np.arange(1 << 16)
                table = np.empty((1 << 16, 2), np.float32)  # [65536, 2] f32
                table[:, 0] = DECODE_TABLE[idx & 0xFF]
                table[:, 1] = DECODE_TABLE[idx >> 8]
                table.flags.writeable = False
                _pair = table
    return _pair
