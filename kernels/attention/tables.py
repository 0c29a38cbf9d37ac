"""Lookup tables that decode fp8 e4m3 codes for the attention kernels (exact, no scale).

``DECODE_TABLE`` (256 x f32) is the codec's table (kernels.fp8): NaN codes read as 0.0.
The codec's pair table decodes TWO adjacent codes at once: the little-endian uint16
``c0 | c1 << 8`` indexes ``(table[c0], table[c1])``, two f32 read here as one u64. A uint16
view of a code row therefore decodes with half the gathers of the byte table, bit-identically.
"""
from __future__ import annotations

import numpy as np

from kernels.fp8 import DECODE_TABLE, USABLE_SCALE_BOUND, pair_table, usable_scales

__all__ = ["SCALE_MAX", "decode_codes_into", "sanitize_scales_into"]

SCALE_MAX = USABLE_SCALE_BOUND  # a usable scale is > 0 and below this (kernels.fp8 holds the bound)
_PAIRS_U64: np.ndarray = pair_table().view("<u8").reshape(65536)  # [65536] u64 = 2 x f32


def decode_codes_into(codes: np.ndarray, out: np.ndarray) -> None:
    """out[...] = DECODE_TABLE[codes] (no scale), through the pair table when the layout allows.

    ``codes``: [n, w] u8, any row stride, last axis contiguous (e.g. a view of mmap'd records);
    ``out``: [n, w] f32, C-contiguous and 8-byte aligned for the pair path; otherwise (odd w, a
    codes view that cannot be read as uint16) the byte table gives the same values.
    """
    n, w = codes.shape
    if n == 0:
        return
    if w % 2 == 0 and codes.strides[1] == 1 and out.flags.c_contiguous and out.ctypes.data % 8 == 0:
        try:
            pairs = codes.view("<u2")  # pairs: [n, w/2] u16
        except ValueError:
            pairs = None
        if pairs is not None:
            np.take(_PAIRS_U64, pairs, out=out.view("<u8"), mode="clip")  # out: [n, w/2] u64 = [n, w] f32
            return
    np.take(DECODE_TABLE, codes, out=out, mode="clip")


def sanitize_scales_into(scales: np.ndarray, out: np.ndarray) -> None:
    """out = scales where usable (> 0 and < 3.4e38), else 0.0: an inert row contributes exactly 0."""
    np.copyto(out, scales)
    bad = ~usable_scales(out)  # bad: [n] bool (NaN, inf, <= 0)
    if bad.any():
        out[bad] = 0.0
