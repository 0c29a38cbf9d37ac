"""The v3 rotation shared by both 4-bit codecs (facts 4.1): a sign flip, then an f32 Walsh-Hadamard.

sign_i = -1 when bit 0 of ``h(0x9E3779B9 ^ i)`` is set (one vector for every width: a width
uses its prefix); the FWHT runs in float32, stage by stage (len = 1, 2, ..., n/2), then every
element is multiplied by the f32 reciprocal ``1 / sqrtf(n)``. rotate(x) = FWHT(x * sign),
unrotate(y) = FWHT(y) * sign; both are self-inverse up to f32 rounding. The radius is the L2 norm
of the ORIGINAL row, summed sequentially in float64 in index order, rounded once to f32.
"""
from __future__ import annotations

import numpy as np

from kernels.errors import FormatError

__all__ = ["MAX_WIDTH", "SIGNS", "WIDTHS", "check_width", "fwht", "row_radius", "rotate", "sign_hash", "unrotate"]

MAX_WIDTH = 512
WIDTHS: tuple[int, ...] = tuple(1 << k for k in range(1, 10))  # 2, 4, ..., 512
_GOLDEN = np.uint32(0x9E3779B9)
_TRANSPOSE_ROWS = 32  # from this many rows the FWHT runs on the transposed block


def check_width(n: int, what: str = "row") -> int:
    """``n`` when it is a power of two in 2..512 (the engine refuses any other width), else FormatError."""
    if not isinstance(n, (int, np.integer)) or int(n) not in WIDTHS:
        raise FormatError(f"v3 codec: {what} width {n!r} must be a power of two in 2..{MAX_WIDTH}")
    return int(n)


def sign_hash(x: np.ndarray) -> np.ndarray:
    """The engine's 32-bit mixer, elementwise mod 2^32: h(x) [..] u32."""
    with np.errstate(over="ignore"):  # mod 2^32 is the point
        v = np.asarray(x, dtype=np.uint32) + _GOLDEN  # v: [..] u32 (wraps)
        v = (v ^ (v >> np.uint32(16))) * np.uint32(0x85EBCA6B)
        v = (v ^ (v >> np.uint32(13))) * np.uint32(0xC2B2AE35)
    return v ^ (v >> np.uint32(16))


def _signs() -> np.ndarray:
    bit = sign_hash(_GOLDEN ^ np.arange(MAX_WIDTH, dtype=np.uint32)) & np.uint32(1)  # bit: [512] u32
    out = np.where(bit == 1, np.float32(-1.0), np.float32(1.0)).astype(np.float32)  # out: [512] f32
    out.setflags(write=False)
    return out


SIGNS: np.ndarray = _signs()  # [512] f32 of +-1


def fwht(a: np.ndarray) -> np.ndarray:
    """The engine's f32 FWHT over the last axis of ``a`` [..., n] -> a new C-contiguous f32 array.

    Each stage computes a[j] = u + v, a[j + len] = u - v for every pair at distance len (the same
    f32 additions as the engine's in-place loop, vectorised), ping-ponging between two buffers;
    then one multiply by the f32 ``1 / sqrtf(n)``. Many rows run transposed ([n, R]: rows on the
    inner axis, so every stage is a few long loops); the arithmetic is the same either way.
    """
    n = check_width(int(a.shape[-1]))
    rows = int(np.prod(a.shape[:-1], dtype=np.int64))
    if rows >= _TRANSPOSE_ROWS:
        src = np.array(np.asarray(a, dtype=np.float32).reshape(rows, n).T, order="C")  # src: [n, R] f32
        out = _stages(src, n, (), (rows,))
        return np.ascontiguousarray(out.T).reshape(a.shape)
    src = np.array(a, dtype=np.float32, order="C", copy=True)  # src: [..., n] f32
    return _stages(src, n, a.shape[:-1], ())


def _stages(src: np.ndarray, n: int, lead: tuple[int, ...], tail: tuple[int, ...]) -> np.ndarray:
    """The FWHT stages over the axis of length n that sits between ``lead`` and ``tail`` axes."""
    dst = np.empty_like(src)
    with np.errstate(over="ignore", invalid="ignore"):  # huge rows overflow in f32, as in the engine
        length = 1
        while length < n:
            s = src.reshape(*lead, n // (2 * length), 2, length, *tail)  # s: [.., blocks, 2, len, ..] f32 view
            d = dst.reshape(*lead, n // (2 * length), 2, length, *tail)
            u = s[(Ellipsis, 0) + (slice(None),) * (1 + len(tail))]
            v = s[(Ellipsis, 1) + (slice(None),) * (1 + len(tail))]
            np.add(u, v, out=d[(Ellipsis, 0) + (slice(None),) * (1 + len(tail))])
            np.subtract(u, v, out=d[(Ellipsis, 1) + (slice(None),) * (1 + len(tail))])
            src, dst = dst, src
            length *= 2
        src *= np.float32(1.0) / np.sqrt(np.float32(n))
    return src


def rotate(x: np.ndarray) -> np.ndarray:
    """FWHT(x * sign) over the last axis: [..., n] f32 -> [..., n] f32."""
    n = check_width(int(x.shape[-1]))
    return fwht(np.multiply(x, SIGNS[:n], dtype=np.float32))


def unrotate(y: np.ndarray) -> np.ndarray:
    """FWHT(y) * sign over the last axis: [..., n] f32 -> [..., n] f32 (the inverse of rotate)."""
    n = check_width(int(y.shape[-1]))
    out = fwht(y)
    out *= SIGNS[:n]
    return out


def row_radius(x: np.ndarray) -> np.ndarray:
    """L2 norm of each row of ``x`` [..., n] f32: sequential float64 sum of x_i*x_i, then f32 -> [...] f32.

    The squares of f32 values are exact in float64; ``cumsum`` adds them strictly in index order
    (numpy's ``sum`` would add pairwise and could differ in the last bit).
    """
    x64 = np.asarray(x, dtype=np.float32).astype(np.float64)  # x64: [..., n] f64
    x64 *= x64
    with np.errstate(invalid="ignore", over="ignore"):
        ss = np.cumsum(x64, axis=-1)[..., -1] if x64.shape[-1] else np.zeros(x64.shape[:-1])  # ss: [...] f64
        return np.sqrt(ss).astype(np.float32)
