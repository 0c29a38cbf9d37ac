"""fp8 e4m3 element codec: float32 values <-> uint8 codes, any shape and strides (FORMAT.md 2).

Encode looks up kernels.fp8.tables.ENCODE_TABLE by the sticky 16-bit key of each f32 pattern;
decode looks up DECODE_TABLE, or pairs of codes in the pair table for long arrays.
"""
from __future__ import annotations

import sys

import numpy as np

from kernels.fp8.blocks import BLOCK, alloc_like, as_codes, as_floats, check_out, elementwise
from kernels.fp8.tables import DECODE_TABLE, ENCODE_TABLE, pair_table

_PAIR_MIN = 1 << 12  # decode arrays at least this long use the pair table
_LO, _HI = (0, 1) if sys.byteorder == "little" else (1, 0)  # u16 halves of a native f32


def encode_flat(src: np.ndarray, dst: np.ndarray) -> None:
    """src: [m] native f32 contiguous -> dst: [m] u8 contiguous."""
    size = src.shape[0]
    sticky = np.empty(min(size, BLOCK), np.uint16)  # [b] u16
    key = np.empty(min(size, BLOCK), np.intp)  # [b] table index
    for i in range(0, size, BLOCK):
        j = min(size, i + BLOCK)
        halves = src[i:j].view(np.uint16)  # [2b] u16
        k = j - i
        np.minimum(halves[_LO::2], 1, out=sticky[:k])  # low 16 bits != 0
        np.bitwise_or(halves[_HI::2], sticky[:k], out=key[:k])  # top 16 bits | sticky
        np.take(ENCODE_TABLE, key[:k], out=dst[i:j], mode="clip")


def decode_flat(src: np.ndarray, dst: np.ndarray) -> None:
    """src: [m] u8 contiguous -> dst: [m] native f32 contiguous."""
    size = src.shape[0]
    use_pairs = size >= _PAIR_MIN and dst.ctypes.data % 8 == 0
    pairs = pair_table().view(np.uint64).reshape(-1) if use_pairs else None  # [65536] 2 x f32
    key = np.empty(min(size, BLOCK), np.intp)  # [b] table index
    for i in range(0, size, 2 * BLOCK):  # even block starts keep dst 8-byte aligned
        j = min(size, i + 2 * BLOCK)
        if pairs is None:
            for a in range(i, j, BLOCK):
                b = min(j, a + BLOCK)
                key[: b - a] = src[a:b]
                np.take(DECODE_TABLE, key[: b - a], out=dst[a:b], mode="clip")
            continue
        even = (j - i) & ~1
        key[: even // 2] = src[i : i + even].view("<u2")  # lo | hi << 8
        np.take(pairs, key[: even // 2], out=dst[i : i + even].view(np.uint64), mode="clip")
        if i + even < j:
            dst[j - 1] = DECODE_TABLE[src[j - 1]]


def encode_into(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Encode float32 values into ``out`` (u8, same shape, any strides); returns ``out``.

    Non-float32 real inputs are first converted to float32 (numpy rounding), then encoded.
    """
    x = as_floats(x, "encode")
    check_out(out, x.shape, np.uint8, "encode_into out")
    if x.size and not elementwise(x, out, np.float32, encode_flat):
        np.copyto(out, encode(x))
    return out


def encode(x: np.ndarray) -> np.ndarray:
    """float32 array (any shape, any strides) -> uint8 e4m3 codes of the same shape."""
    x = as_floats(x, "encode")
    if x.dtype == np.float32 and x.flags.c_contiguous and x.size <= BLOCK:  # small: one pass
        halves = x.reshape(-1).view(np.uint16)  # [2N] u16
        key = halves[_HI::2] | np.minimum(halves[_LO::2], 1)  # [N] u16
        codes: np.ndarray = ENCODE_TABLE[key].reshape(x.shape)  # codes: [*x.shape] u8
        return codes
    return encode_into(x, alloc_like(x, np.uint8))


def decode_into(codes: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Decode uint8 codes into ``out`` (native f32, same shape, any strides); returns ``out``."""
    codes = as_codes(codes, "decode")
    check_out(out, codes.shape, np.float32, "decode_into out")
    if codes.size and not elementwise(codes, out, np.uint8, decode_flat):
        np.copyto(out, decode(codes))
    return out


def decode(codes: np.ndarray) -> np.ndarray:
    """uint8 e4m3 codes (any shape, any strides) -> float32 values (NaN codes -> 0.0)."""
    codes = as_codes(codes, "decode")
    if codes.flags.c_contiguous and codes.size < _PAIR_MIN:  # small: one lookup
        values: np.ndarray = DECODE_TABLE[codes.reshape(-1)].reshape(codes.shape)  # values: [*codes.shape] f32
        return values
    return decode_into(codes, alloc_like(codes, np.float32))
