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

__all__ = ["LEVELS", "LEVEL_PAIRS", "decode_levels_into", "encode_rotated", "int4_std", "nearest_levels"]

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
    """Index of the nearest level for each element of z [..] f32 -> [..] u8 (the engine's scan order)."""
    best = np.abs(z - LEVELS[0])  # best: [..] f32
    code = np.zeros(z.shape, np.uint8)  # code: [..] u8
    dist = np.empty_like(best)  # dist: [..] f32
    closer = np.empty(z.shape, np.bool_)  # closer: [..] bool
    for k in range(1, 16):
        np.subtract(z, LEVELS[k], out=dist)
        np.abs(dist, out=dist)
        np.less(dist, best, out=closer)
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
