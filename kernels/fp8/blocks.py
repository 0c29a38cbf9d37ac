"""Array plumbing shared by the fp8 codec and row quantizer: argument checks, cache-sized blocks
in C order, and outputs laid out in their input's memory order.

Work runs in blocks of at most ``BLOCK`` elements, so temporaries stay small whatever the input
size; any shape and any strides come in, C-order results go out.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from kernels.errors import FormatError

BLOCK = 1 << 16  # elements per block: keeps every temporary in L2


# ---------------------------------------------------------------- argument checks


def as_floats(x: object, what: str) -> np.ndarray:
    """x as an array of real numbers (converted to float32 by the callers), else FormatError."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu":
        raise FormatError(f"{what}: expected a float32 array, found dtype {arr.dtype}")
    return arr


def as_codes(codes: object, what: str) -> np.ndarray:
    """codes as a uint8 array (an int8 array is viewed as uint8), else FormatError."""
    arr = np.asarray(codes)
    if arr.dtype == np.int8:
        arr = arr.view(np.uint8)
    if arr.dtype != np.uint8:
        raise FormatError(f"{what}: expected uint8 fp8 codes, found dtype {arr.dtype}")
    return arr


def check_out(out: object, shape: tuple[int, ...], dtype: type, what: str) -> np.ndarray:
    """out, when it is a writeable ``dtype`` array of ``shape``; else FormatError naming it."""
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


def blocks(x: np.ndarray, dtype: type, whole_rows: bool) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yield (start, stop, block): x in C order as C-contiguous ``dtype`` blocks.

    start/stop are flat C-order offsets. Blocks hold at most BLOCK elements, whole rows of
    the last axis when ``whole_rows`` (a longer row then comes alone). x.size > 0.
    """
    n = x.shape[-1]
    rows = _row_view(x, n)  # [R, n]
    if rows is None:  # ndim >= 3 with unmergeable leading axes: walk axis 0
        step = x[0].size
        for i in range(x.shape[0]):
            for a, b, blk in blocks(x[i], dtype, whole_rows):
                yield i * step + a, i * step + b, blk
        return
    if n <= BLOCK or whole_rows:
        group = max(1, BLOCK // n)
        for r0 in range(0, rows.shape[0], group):
            r1 = min(rows.shape[0], r0 + group)
            yield r0 * n, r1 * n, np.ascontiguousarray(rows[r0:r1], dtype=dtype)  # [g, n]
        return
    for r in range(rows.shape[0]):
        for c0 in range(0, n, BLOCK):
            c1 = min(n, c0 + BLOCK)
            yield r * n + c0, r * n + c1, np.ascontiguousarray(rows[r, c0:c1], dtype=dtype)


# ---------------------------------------------------------------- memory order


def _memory_perm(a: np.ndarray) -> tuple[int, ...]:
    """Axes ordered outermost-in-memory first (numpy's order='K'); identity when C-contiguous."""
    if a.ndim < 2 or a.flags.c_contiguous:
        return tuple(range(a.ndim))
    return tuple(sorted(range(a.ndim), key=lambda i: -abs(a.strides[i])))


def alloc_like(a: np.ndarray, dtype: type) -> np.ndarray:
    """An empty array of a's shape laid out in a's memory order (so a transposed input stays fast)."""
    perm = _memory_perm(a)
    return np.empty([a.shape[i] for i in perm], dtype).transpose(np.argsort(perm))


def elementwise(src: np.ndarray, out: np.ndarray, dtype: type,
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
    for a, b, blk in blocks(src_p.reshape(src_p.shape or (1,)), dtype, whole_rows=False):
        flat_fn(blk.reshape(-1), flat_out[a:b])
    return True
