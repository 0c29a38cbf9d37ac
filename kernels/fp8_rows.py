"""fp8 row quantizer and dequantizer of ``.coli_kv`` v2 rows, bit-exact to the colibri engine.

Per row of n float32 values (FORMAT.md section 2), every operation in float32: amax = max |x|
over the non-NaN values (quiet and signalling NaNs alike); a row with not (amax > 1e-35f) or
amax > 3.4e38f gets all-zero codes and scale 1.0; otherwise codes = encode(x * (448/amax)) and
scale = amax/448. Reading, a row whose scale is not (> 0 and < 3.4e38f) is inert and reads as +0.0.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kernels.errors import FormatError
from kernels.fp8_blocks import as_codes, as_floats, blocks, check_out
from kernels.fp8_codec import decode_flat, encode_flat

FP8_MAX = 448.0
_F448 = np.float32(448.0)
_AMAX_MIN = np.float32(1e-35)  # the engine's 1e-35f: a row needs amax > this
# The engine's 3.4e38f, the one home of this bound: a row whose amax is larger is a zero row, and a
# stored scale is usable only when > 0 and below it (else the row is inert and reads as 0).
USABLE_SCALE_BOUND = np.float32(3.4e38)


def usable_scales(scales: Any) -> Any:
    """The engine's test for a v2 row scale, the one mask every reader applies: 0 < scale <
    3.4e38f (NaN and inf fail it). ``scales``: a numpy or cupy array; returns its bool mask."""
    return (scales > 0) & (scales < USABLE_SCALE_BOUND)


def _row_amax(work: np.ndarray) -> np.ndarray:
    """work: [g, n] f32 |x| -> [g] f32 row maxima over the non-NaN values (0 for an all-NaN row).

    Not ``np.fmax.reduce``: numpy's fmax returns NaN when one operand is a signalling NaN (the C
    fmax rule), so a running maximum that meets one in a scalar loop (rows not a multiple of the
    SIMD width, or the column-wise loop of short rows) is replaced by the next value. ``np.maximum``
    propagates every NaN instead; the rare rows that end as NaN are reduced again with NaNs as 0.
    """
    amax: np.ndarray = np.maximum.reduce(work, axis=1, initial=np.float32(0))  # [g] f32, NaN if any NaN
    nan_rows = np.isnan(amax)  # [g] bool
    if nan_rows.any():
        sub = work[nan_rows]  # [k, n] f32 copy
        sub[np.isnan(sub)] = 0.0
        amax[nan_rows] = np.maximum.reduce(sub, axis=1, initial=np.float32(0))
    return amax


def _quantize_block(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
    """x: [g, n] f32 contiguous -> codes [g, n] u8 contiguous, scales [g] f32."""
    work = np.abs(x)  # [g, n] f32
    amax = _row_amax(work)  # [g] f32, NaN ignored
    usable = (amax > _AMAX_MIN) & ~(amax > USABLE_SCALE_BOUND)  # [g] bool
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = _F448 / amax  # [g] f32
        np.multiply(x, inv[:, None], out=work)  # [g, n] f32: x * inv in f32
    encode_flat(work.reshape(-1), codes.reshape(-1))
    np.divide(amax, _F448, out=scales)  # [g] f32
    if not usable.all():
        codes[~usable] = 0
        scales[~usable] = 1.0


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
