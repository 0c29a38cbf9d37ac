"""Codec 1 of v3 rows: rotated int4 (facts 4.2), over blocks of rows.

Encode: y = rotate(x); z = y * (sqrtf(n) / radius) (f32); code = the nearest of the 16 Lloyd-Max
levels, scanning upwards with a strict ``<`` (a tie keeps the lower index; a NaN keeps code 0);
two codes per byte, the even element in the low nibble. Decode: lev[code] * (radius / sqrtf(n)),
then unrotate. ``LEVEL_PAIRS`` maps a byte to its two levels at once (an 8-byte entry), so
decoding a row of n/2 bytes is one table lookup per byte.
"""
from __future__ import annotations

import numpy as np

from kernels.tq.packing import pack_nibbles
from kernels.tq.rotation import rotate

__all__ = ["LEVELS", "LEVEL_PAIRS", "decode_levels_into", "encode_rotated", "int4_std", "nearest_levels", "scan_levels"]

_HALF = (0.128, 0.388, 0.657, 0.942, 1.256, 1.618, 2.069, 2.733)  # N(0,1) Lloyd-Max, the engine's literals
LEVELS: np.ndarray = np.array([-v for v in reversed(_HALF)] + list(_HALF), dtype=np.float32)  # [16] f32
LEVELS.setflags(write=False)


def _level_pairs() -> np.ndarray:
    b = np.arange(256)
    pairs = np.stack([LEVELS[b & 15], LEVELS[b >> 4]], axis=1).astype(np.float32)  # pairs: [256, 2] f32
    table = np.ascontiguousarray(pairs).view(np.uint64).reshape(256)  # table: [256] u64 = (low, high) f32
    table.setflags(write=False)
    return table


LEVEL_PAIRS: np.ndarray = _level_pairs()  # [256] u64: byte -> (lev[low nibble], lev[high nibble])


def int4_std(radius: np.ndarray, n: int) -> np.ndarray:
    """radius / sqrtf(n) in f32: the per-row factor of the decoded levels. radius: [R] f32 -> [R] f32."""
    return np.asarray(radius, np.float32) / np.sqrt(np.float32(n))  # type: ignore[no-any-return]


def nearest_levels(z: np.ndarray) -> np.ndarray:
    """Index of the nearest level for each element of z [..] f32 -> [..] u8 (the engine's scan order).

    f32 rounding of |z - lev| is monotone in lev on each side of z, so for |z| <= 1e4 (every finite
    z of a usable row: |z| <= sqrtf(n) up to rounding) the scan's winner is one of the two levels
    around z, the lower one on a tie. Other elements (inf, NaN, overflowed rows) take the full scan.
    """
    code = np.zeros(z.shape, np.uint8)  # code: [..] u8, first the index of the level just below z (0..14)
    above = np.empty(z.shape, np.bool_)  # above: [..] bool
    for k in range(1, 15):  # counting thresholds: 14 cheap passes (np.searchsorted is ~6x slower here)
        np.greater_equal(z, LEVELS[k], out=above)
        code += above
    d_lo = np.abs(z - LEVELS[code])  # d_lo: [..] f32
    d_hi = np.abs(z - LEVELS[code + 1])  # d_hi: [..] f32
    code += d_hi < d_lo
    odd = ~(np.abs(z) <= np.float32(1e4))  # odd: [..] bool (NaN included)
    if odd.any():
        code[odd] = scan_levels(z[odd])
    return code


def scan_levels(z: np.ndarray) -> np.ndarray:
    """The engine's loop as written: k = 0..15, replace on a strictly smaller |z - lev[k]|. z: [..] f32 -> [..] u8."""
    best = np.abs(z - LEVELS[0])  # best: [..] f32
    code = np.zeros(z.shape, np.uint8)  # code: [..] u8
    for k in range(1, 16):
        dist = np.abs(z - LEVELS[k])  # dist: [..] f32
        closer = dist < best  # closer: [..] bool
        np.copyto(best, dist, where=closer)
        np.copyto(code, np.uint8(k), where=closer)
    return code


def encode_rotated(x: np.ndarray, radius: np.ndarray) -> np.ndarray:
    """x [R, n] f32 rows with usable radius [R] f32 -> packed codes [R, n/2] u8."""
    n = x.shape[-1]
    y = rotate(x)  # y: [R, n] f32
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        invstd = np.sqrt(np.float32(n)) / radius  # invstd: [R] f32
        y *= invstd[:, None]  # z: [R, n] f32
    return pack_nibbles(nearest_levels(y))


def decode_levels_into(packed: np.ndarray, out: np.ndarray) -> None:
    """out[r, i] = LEVELS[code i of row r] (no scale): packed [R, n/2] u8 (any row stride) -> out [R, n] f32.

    ``out`` must be C-contiguous and 8-byte aligned; each byte becomes its two levels in one lookup.
    """
    if packed.shape[0] == 0:
        return
    np.take(LEVEL_PAIRS, packed, out=out.view(np.uint64), mode="clip")  # out: [R, n/2] u64 = [R, n] f32
