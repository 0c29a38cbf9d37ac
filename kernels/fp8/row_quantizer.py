"""fp8 row quantizer and dequantizer of ``.coli_kv`` v2 rows, bit-exact to the colibri engine.

Per row of n float32 values (FORMAT.md section 2), every operation in float32: amax = max |x|
over the non-NaN values (quiet and signalling NaNs alike); a row with not (amax > 1e-35f) or
amax > 3.4e38f gets all-zero codes and scale 1.0; otherwise codes = encode(x * (448/amax)) and
scale = amax/448. Reading, a row whose scale is not (> 0 and < 3.4e38f) is inert and reads as +0.0.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types, void

from kernels.compile_notice import announce_if_cold
from kernels.errors import FormatError
from kernels.fp8.blocks import as_codes, as_floats, blocks, check_out
from kernels.fp8.codec import decode_flat
from kernels.fp8.scales import USABLE_SCALE_BOUND, usable_scales
from kernels.fp8.tables import ENCODE_TABLE

FP8_MAX = 448.0
_F448 = np.float32(448.0)
_AMAX_MIN = np.float32(1e-35)  # the engine's 1e-35f: a row needs amax > this


def _quantize_rows(x: np.ndarray, codes: np.ndarray, scales: np.ndarray,
                   table: np.ndarray) -> None:  # pragma: no cover - compiled
    """x: [g, n] f32 -> codes [g, n] u8, scales [g] f32, row by row, every operation in f32.

    amax is a running maximum of |x| that a NaN never replaces (``v > amax`` is false for every
    NaN, quiet or signalling); each product x * (448/amax) is encoded by its sticky 16-bit key
    (top 16 bits | any low bit set) through ``table`` (ENCODE_TABLE), as ``encode_flat`` does.
    """
    n = x.shape[1]
    work = np.empty(n, np.float32)  # work: [n] f32, one row's products
    bits = work.view(np.uint32)  # [n] u32: their patterns
    for i in range(x.shape[0]):
        amax = np.float32(0.0)
        for j in range(n):
            v = abs(x[i, j])
            if v > amax:
                amax = v
        if amax > _AMAX_MIN and not amax > USABLE_SCALE_BOUND:
            inv = _F448 / amax
            for j in range(n):
                work[j] = x[i, j] * inv
            for j in range(n):
                u = bits[j]
                codes[i, j] = table[(u >> 16) | (1 if u & 0xFFFF else 0)]
            scales[i] = amax / _F448
        else:  # a zero row (amax <= 1e-35f, or only NaNs) or one past 3.4e38f: codes 0, scale 1
            for j in range(n):
                codes[i, j] = 0
            scales[i] = np.float32(1.0)


def _quantize_signature(readonly: bool) -> Any:
    rows = types.Array(types.float32, 2, "C", readonly=readonly)
    out_codes, out_scales = types.Array(types.uint8, 2, "C"), types.Array(types.float32, 1, "C")
    return void(rows, out_codes, out_scales, types.Array(types.uint8, 1, "C", readonly=True))


# Compiled (numba, strict IEEE f32: the same products and quotients as numpy's, bit for bit): the
# numpy version made ~6 passes over each block and cost ~150 us per call whatever its size, a
# third of a small model's decode step (one call per layer for lc and one for rc).
announce_if_cold(__file__)  # numba compiles the kernels below now unless cached
_QUANTIZE = {ro: njit(_quantize_signature(ro), cache=True, nogil=True, boundscheck=False)(_quantize_rows)
             for ro in (False, True)}
quantize_rows_kernel = _QUANTIZE[False]  # (x [g, n] f32, codes [g, n] u8, scales [g] f32, ENCODE_TABLE): for
# compiled callers (kernels.model.compiled_step), which encode inside their own kernel


def _quantize_block(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
    """x: [g, n] f32 contiguous -> codes [g, n] u8 contiguous, scales [g] f32."""
    _QUANTIZE[not x.flags.writeable](x, codes, scales, ENCODE_TABLE)


def quantize_rows_into(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
    """Row quantizer writing into ``codes`` (u8 [..., n]) and ``scales`` (f32 [...]), any strides."""
    x = as_floats(x, "quantize_rows")
    if x.ndim == 0:
        raise FormatError("quantize_rows: expected rows [..., n], found a 0-d array")
    check_out(codes, x.shape, np.uint8, "quantize_rows_into codes")
    check_out(scales, x.shape[:-1], np.float32, "quantize_rows_into scales")
    if not (codes.flags.c_contiguous and scales.flags.c_contiguous):
        got_codes, got_scales = quantize_rows(x)
        np.copyto(codes, got_codes)
        np.copyto(scales, got_scales)
        return
    n = x.shape[-1]
    if x.size == 0:
        scales[...] = 1.0  # an empty row has amax 0: scale 1.0
        return
    flat_codes, flat_scales = codes.reshape(-1), scales.reshape(-1)  # [R*n] u8, [R] f32
    for a, b, blk in blocks(x, np.float32, whole_rows=True):
        _quantize_block(blk.reshape(-1, n), flat_codes[a:b].reshape(-1, n), flat_scales[a // n : b // n])


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [..., n] -> (codes u8 [..., n], scales f32 [...]), the engine's row rule.

    amax = max |x| over non-NaN values; a row with not (amax > 1e-35f) or amax > 3.4e38f gets
    all-zero codes and scale 1.0; otherwise codes = encode(x * (448/amax)), scale = amax/448,
    every operation in float32.
    """
    x = as_floats(x, "quantize_rows")
    if x.ndim == 0:
        raise FormatError("quantize_rows: expected rows [..., n], found a 0-d array")
    codes = np.empty(x.shape, np.uint8)  # [..., n] u8
    scales = np.empty(x.shape[:-1], np.float32)  # [...] f32
    quantize_rows_into(x, codes, scales)
    return codes, scales


def _dequantize_block(codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    """codes [g, n] u8 contiguous, scales [g] f32 -> out [g, n] f32 contiguous."""
    decode_flat(codes.reshape(-1), out.reshape(-1))
    usable = usable_scales(scales)  # [g] bool: the engine's reading rule
    with np.errstate(over="ignore"):  # a usable scale above f32max/448 gives +-inf, as in the engine
        np.multiply(out, np.where(usable, scales, np.float32(0))[:, None], out=out)
    if not usable.all():
        out[~usable] = 0.0  # inert row: +0.0 exactly, as codes 0 with scale 1


def dequantize_rows_into(codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``DECODE_TABLE[codes] * scale`` per row into ``out`` (f32 [..., n]); returns ``out``.

    A row whose scale is not (> 0 and < 3.4e38f) is inert and reads as +0.0 (the engine's rule).
    """
    codes = as_codes(codes, "dequantize_rows")
    if codes.ndim == 0:
        raise FormatError("dequantize_rows: expected code rows [..., n], found a 0-d array")
    scales = np.asarray(scales)
    if scales.dtype.kind != "f" or scales.shape != codes.shape[:-1]:
        raise FormatError(
            f"dequantize_rows: expected float32 scales {codes.shape[:-1]}, "
            f"found {scales.dtype} {scales.shape}"
        )
    check_out(out, codes.shape, np.float32, "dequantize_rows_into out")
    if codes.size == 0:
        return out
    if not out.flags.c_contiguous:
        np.copyto(out, dequantize_rows(codes, scales))
        return out
    n = codes.shape[-1]
    flat_scales = np.ascontiguousarray(scales, dtype=np.float32).reshape(-1)  # [R] f32
    flat_out = out.reshape(-1)  # [R*n] f32
    for a, b, blk in blocks(codes, np.uint8, whole_rows=True):
        _dequantize_block(blk.reshape(-1, n), flat_scales[a // n : b // n], flat_out[a:b].reshape(-1, n))
    return out


def dequantize_rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes u8 [..., n] + scales f32 [...] -> f32 [..., n] (inert rows read as 0.0)."""
    codes = as_codes(codes, "dequantize_rows")
    return dequantize_rows_into(codes, scales, np.empty(codes.shape, np.float32))
