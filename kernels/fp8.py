"""fp8 e4m3 (OCP e4m3fn) codec of ``.coli_kv`` v2 rows, bit-exact to the colibri engine.

Rules (FORMAT.md section 2): decode is a 256-entry table, NaN codes (0x7F, 0xFF) read as +0.0.
Encode of one float32: NaN -> 0x00; |x| > 448 or inf -> sign|0x7E; otherwise round half to even
onto the e4m3 grid (subnormal step 2^-9), the sign bit kept (-0.0 and negative underflow -> 0x80).
The row quantizer scales each row by 448/amax (f32 ops) before encoding; scale = amax/448.

Speed: encode looks up a 65,536-entry table by the top 16 bits of the f32 pattern with bit 0
replaced by "bit 0 OR any of the low 16 bits set". For every f32 the rounding position sits at
mantissa bit 19 or higher, so the low 17 bits only ever act as a sticky bit and that key decides
the code exactly (ties included). Decode looks up pairs of codes in a 65,536 x 2 table.
Work runs in cache-sized blocks, so temporaries stay small whatever the input size; any shape,
any strides, C order in and out.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kernels.errors import FormatError

__all__ = [
    "DECODE_TABLE",
    "FP8_MAX",
    "USABLE_SCALE_BOUND",
    "usable_scales",
    "PAIR_TABLE",
    "decode",
    "decode_into",
    "dequantize_rows",
    "dequantize_rows_into",
    "encode",
    "encode_into",
    "encode_reference",
    "pair_table",
    "quantize_rows",
    "quantize_rows_into",
]

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
_BLOCK = 1 << 16  # elements per block: keeps every temporary in L2
_PAIR_MIN = 1 << 12  # decode arrays at least this long use the pair table
_LO, _HI = (0, 1) if sys.byteorder == "little" else (1, 0)  # u16 halves of a native f32


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


_ENCODE_TABLE = _build_encode_table()  # [65536] u8, read-only
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


PAIR_TABLE: np.ndarray  # declared only (no value): the module __getattr__ below builds it on first use


def __getattr__(name: str) -> np.ndarray:  # PEP 562: PAIR_TABLE is built on first use
    if name == "PAIR_TABLE":
        return pair_table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------- argument checks


def _as_floats(x: object, what: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu":
        raise FormatError(f"{what}: expected a float32 array, found dtype {arr.dtype}")
    return arr


def _as_codes(codes: object, what: str) -> np.ndarray:
    arr = np.asarray(codes)
    if arr.dtype == np.int8:
        arr = arr.view(np.uint8)
    if arr.dtype != np.uint8:
        raise FormatError(f"{what}: expected uint8 fp8 codes, found dtype {arr.dtype}")
    return arr


def _check_out(out: object, shape: tuple[int, ...], dtype: type, what: str) -> np.ndarray:
    if not isinstance(out, np.ndarray) or out.dtype != dtype or out.shape != shape:
        found = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise FormatError(f"{what}: expected {np.dtype(dtype)} {shape}, found {found}")
    if not out.flags.writeable:
        raise FormatError(f"{what}: output array is read-only")
    return out


# ---------------------------------------------------------------- block iteration


def _row_view(x: np.ndarray, n: int) -> np.ndarray | None:
    """x as a [R, n] view without copying, or None when the leading axes cannot merge."""
    try:
        return np.reshape(x, (-1, n), copy=False)
    except TypeError:  # numpy < 2.1: no copy= argument
        view = x.view()
        try:
            view.shape = (-1, n)
        except AttributeError:
            return None
        return view
    except ValueError:
        return None


def _blocks(x: np.ndarray, dtype: type, whole_rows: bool) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yield (start, stop, block): x in C order as C-contiguous ``dtype`` blocks.

    start/stop are flat C-order offsets. Blocks hold at most _BLOCK elements, whole rows of
    the last axis when ``whole_rows`` (a longer row then comes alone). x.size > 0.
    """
    n = x.shape[-1]
    rows = _row_view(x, n)  # [R, n]
    if rows is None:  # ndim >= 3 with unmergeable leading axes: walk axis 0
        step = x[0].size
        for i in range(x.shape[0]):
            for a, b, blk in _blocks(x[i], dtype, whole_rows):
                yield i * step + a, i * step + b, blk
        return
    if n <= _BLOCK or whole_rows:
        group = max(1, _BLOCK // n)
        for r0 in range(0, rows.shape[0], group):
            r1 = min(rows.shape[0], r0 + group)
            yield r0 * n, r1 * n, np.ascontiguousarray(rows[r0:r1], dtype=dtype)  # [g, n]
        return
    for r in range(rows.shape[0]):
        for c0 in range(0, n, _BLOCK):
            c1 = min(n, c0 + _BLOCK)
            yield r * n + c0, r * n + c1, np.ascontiguousarray(rows[r, c0:c1], dtype=dtype)


# ---------------------------------------------------------------- flat kernels


def _encode_flat(src: np.ndarray, dst: np.ndarray) -> None:
    """src: [m] native f32 contiguous -> dst: [m] u8 contiguous."""
    size = src.shape[0]
    sticky = np.empty(min(size, _BLOCK), np.uint16)  # [b] u16
    key = np.empty(min(size, _BLOCK), np.intp)  # [b] table index
    for i in range(0, size, _BLOCK):
        j = min(size, i + _BLOCK)
        halves = src[i:j].view(np.uint16)  # [2b] u16
        k = j - i
        np.minimum(halves[_LO::2], 1, out=sticky[:k])  # low 16 bits != 0
        np.bitwise_or(halves[_HI::2], sticky[:k], out=key[:k])  # top 16 bits | sticky
        np.take(_ENCODE_TABLE, key[:k], out=dst[i:j], mode="clip")


def _decode_flat(src: np.ndarray, dst: np.ndarray) -> None:
    """src: [m] u8 contiguous -> dst: [m] native f32 contiguous."""
    size = src.shape[0]
    use_pairs = size >= _PAIR_MIN and dst.ctypes.data % 8 == 0
    pairs = pair_table().view(np.uint64).reshape(-1) if use_pairs else None  # [65536] 2 x f32
    key = np.empty(min(size, _BLOCK), np.intp)  # [b] table index
    for i in range(0, size, 2 * _BLOCK):  # even block starts keep dst 8-byte aligned
        j = min(size, i + 2 * _BLOCK)
        if pairs is None:
            for a in range(i, j, _BLOCK):
                b = min(j, a + _BLOCK)
                key[: b - a] = src[a:b]
                np.take(DECODE_TABLE, key[: b - a], out=dst[a:b], mode="clip")
            continue
        even = (j - i) & ~1
        key[: even // 2] = src[i : i + even].view("<u2")  # lo | hi << 8
        np.take(pairs, key[: even // 2], out=dst[i : i + even].view(np.uint64), mode="clip")
        if i + even < j:
            dst[j - 1] = DECODE_TABLE[src[j - 1]]


# ---------------------------------------------------------------- public codec


def _memory_perm(a: np.ndarray) -> tuple[int, ...]:
    """Axes ordered outermost-in-memory first (numpy's order='K'); identity when C-contiguous."""
    if a.ndim < 2 or a.flags.c_contiguous:
        return tuple(range(a.ndim))
    return tuple(sorted(range(a.ndim), key=lambda i: -abs(a.strides[i])))


def _alloc_like(a: np.ndarray, dtype: type) -> np.ndarray:
    """An empty array of a's shape laid out in a's memory order (so a transposed input stays fast)."""
    perm = _memory_perm(a)
    return np.empty([a.shape[i] for i in perm], dtype).transpose(np.argsort(perm))


def _elementwise(src: np.ndarray, out: np.ndarray, dtype: type,
                 flat_fn: Callable[[np.ndarray, np.ndarray], None]) -> bool:
    """Run flat_fn over src -> out in memory order; False when out has no usable layout."""
    perm = _memory_perm(src)
    src_p, out_p = src.transpose(perm), out.transpose(perm)
    if not out_p.flags.c_contiguous:
        src_p, out_p = src, out
        if not out_p.flags.c_contiguous:
            return False
    flat_out = out_p.reshape(-1)  # [N] view in out's memory order
    if src_p.dtype == dtype and src_p.flags.c_contiguous:
        flat_fn(src_p.reshape(-1), flat_out)
        return True
    for a, b, blk in _blocks(src_p.reshape(src_p.shape or (1,)), dtype, whole_rows=False):
        flat_fn(blk.reshape(-1), flat_out[a:b])
    return True


def encode_into(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Encode float32 values into ``out`` (u8, same shape, any strides); returns ``out``.

    Non-float32 real inputs are first converted to float32 (numpy rounding), then encoded.
    """
    x = _as_floats(x, "encode")
    _check_out(out, x.shape, np.uint8, "encode_into out")
    if x.size and not _elementwise(x, out, np.float32, _encode_flat):
        np.copyto(out, encode(x))
    return out


def encode(x: np.ndarray) -> np.ndarray:
    """float32 array (any shape, any strides) -> uint8 e4m3 codes of the same shape."""
    x = _as_floats(x, "encode")
    if x.dtype == np.float32 and x.flags.c_contiguous and x.size <= _BLOCK:  # small: one pass
        halves = x.reshape(-1).view(np.uint16)  # [2N] u16
        key = halves[_HI::2] | np.minimum(halves[_LO::2], 1)  # [N] u16
        codes: np.ndarray = _ENCODE_TABLE[key].reshape(x.shape)  # codes: [*x.shape] u8
        return codes
    return encode_into(x, _alloc_like(x, np.uint8))


def decode_into(codes: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Decode uint8 codes into ``out`` (native f32, same shape, any strides); returns ``out``."""
    codes = _as_codes(codes, "decode")
    _check_out(out, codes.shape, np.float32, "decode_into out")
    if codes.size and not _elementwise(codes, out, np.uint8, _decode_flat):
        np.copyto(out, decode(codes))
    return out


def decode(codes: np.ndarray) -> np.ndarray:
    """uint8 e4m3 codes (any shape, any strides) -> float32 values (NaN codes -> 0.0)."""
    codes = _as_codes(codes, "decode")
    if codes.flags.c_contiguous and codes.size < _PAIR_MIN:  # small: one lookup
        values: np.ndarray = DECODE_TABLE[codes.reshape(-1)].reshape(codes.shape)  # values: [*codes.shape] f32
        return values
    return decode_into(codes, _alloc_like(codes, np.float32))


# ---------------------------------------------------------------- row quantizer


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
    _encode_flat(work.reshape(-1), codes.reshape(-1))
    np.divide(amax, _F448, out=scales)  # [g] f32
    if not usable.all():
        codes[~usable] = 0
        scales[~usable] = 1.0


def quantize_rows_into(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
    """Row quantizer writing into ``codes`` (u8 [..., n]) and ``scales`` (f32 [...]), any strides."""
    x = _as_floats(x, "quantize_rows")
    if x.ndim == 0:
        raise FormatError("quantize_rows: expected rows [..., n], found a 0-d array")
    _check_out(codes, x.shape, np.uint8, "quantize_rows_into codes")
    _check_out(scales, x.shape[:-1], np.float32, "quantize_rows_into scales")
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
    for a, b, blk in _blocks(x, np.float32, whole_rows=True):
        _quantize_block(blk.reshape(-1, n), flat_codes[a:b].reshape(-1, n), flat_scales[a // n : b // n])


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [..., n] -> (codes u8 [..., n], scales f32 [...]), the engine's row rule.

    amax = max |x| over non-NaN values; a row with not (amax > 1e-35f) or amax > 3.4e38f gets
    all-zero codes and scale 1.0; otherwise codes = encode(x * (448/amax)), scale = amax/448,
    every operation in float32.
    """
    x = _as_floats(x, "quantize_rows")
    if x.ndim == 0:
        raise FormatError("quantize_rows: expected rows [..., n], found a 0-d array")
    codes = np.empty(x.shape, np.uint8)  # [..., n] u8
    scales = np.empty(x.shape[:-1], np.float32)  # [...] f32
    quantize_rows_into(x, codes, scales)
    return codes, scales


def _dequantize_block(codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    """codes [g, n] u8 contiguous, scales [g] f32 -> out [g, n] f32 contiguous."""
    _decode_flat(codes.reshape(-1), out.reshape(-1))
    usable = usable_scales(scales)  # [g] bool: the engine's reading rule
    with np.errstate(over="ignore"):  # a usable scale above f32max/448 gives +-inf, as in the engine
        np.multiply(out, np.where(usable, scales, np.float32(0))[:, None], out=out)
    if not usable.all():
        out[~usable] = 0.0  # inert row: +0.0 exactly, as codes 0 with scale 1


def dequantize_rows_into(codes: np.ndarray, scales: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``DECODE_TABLE[codes] * scale`` per row into ``out`` (f32 [..., n]); returns ``out``.

    A row whose scale is not (> 0 and < 3.4e38f) is inert and reads as +0.0 (the engine's rule).
    """
    codes = _as_codes(codes, "dequantize_rows")
    if codes.ndim == 0:
        raise FormatError("dequantize_rows: expected code rows [..., n], found a 0-d array")
    scales = np.asarray(scales)
    if scales.dtype.kind != "f" or scales.shape != codes.shape[:-1]:
        raise FormatError(
            f"dequantize_rows: expected float32 scales {codes.shape[:-1]}, "
            f"found {scales.dtype} {scales.shape}"
        )
    _check_out(out, codes.shape, np.float32, "dequantize_rows_into out")
    if codes.size == 0:
        return out
    if not out.flags.c_contiguous:
        np.copyto(out, dequantize_rows(codes, scales))
        return out
    n = codes.shape[-1]
    flat_scales = np.ascontiguousarray(scales, dtype=np.float32).reshape(-1)  # [R] f32
    flat_out = out.reshape(-1)  # [R*n] f32
    for a, b, blk in _blocks(codes, np.uint8, whole_rows=True):
        _dequantize_block(blk.reshape(-1, n), flat_scales[a // n : b // n], flat_out[a:b].reshape(-1, n))
    return out


def dequantize_rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes u8 [..., n] + scales f32 [...] -> f32 [..., n] (inert rows read as 0.0)."""
    codes = _as_codes(codes, "dequantize_rows")
    return dequantize_rows_into(codes, scales, np.empty(codes.shape, np.float32))
