"""The compiled step's product for weights past ``THREADED_BYTES`` (GLM-5.2's projections and
experts): every weight element is read from memory ONCE per step for all the step's rows, and each
output element is still the same chain as :func:`kernels.model.rowwise.rows_times` gives
(``((0 + x[0] * w[0, n]) + x[1] * w[1, n]) + ...``, k ascending, a multiply then an add, numba's
strict IEEE mode: no FMA contraction, no reassociation), so a row's bits do not depend on which
rows share the step nor how many (batch invariance).

Why another loop order: :func:`~kernels.model.rowwise.rows_times` streams a block of up to 4,096
columns of the weights past four rows at a time, so a step of 16 rows reads 100 MB-class weights
four times from memory. Here a tile of ``TILE`` output columns holds the sums of up to ``ROWS`` rows
(``ROWS x TILE`` f32 = 16 KiB, in L1) while each weight row's tile segment passes once, and the
rows take it from L1 four at a time. Tiles are split across threads (``prange``): each output
element is one thread's whole chain, so threads change the speed, never the bits.

The rows are gathered (``xi``) and scattered (``oi``) by index, so one kernel serves plain rows
(identity indices) and an expert's (row, slot) pairs.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.compile_notice import announce_if_cold
from kernels.model.rowwise import heads_times, rows_times

TILE = 256  # output columns per tile (1 KiB of each weight row)
ROWS = 16  # rows whose sums a tile holds at once: ROWS x TILE f32 = 16 KiB in L1; more rows: the tile again

announce_if_cold(__file__)


@njit(cache=True, nogil=True, boundscheck=False, parallel=True)
def gather_times(x: np.ndarray, xi: np.ndarray, wt: np.ndarray, out: np.ndarray,
                 oi: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[oi[r]] [N] = x[xi[r]] [K] @ wt [K, N] for each r < len(xi), k ascending per element;
    every weight element read once per ``ROWS`` rows (once per step of up to 16 rows)."""
    n_rows = xi.shape[0]
    depth, width = wt.shape
    n_tiles = (width + TILE - 1) // TILE
    for t in prange(n_tiles):
        n0 = t * TILE
        n1 = min(n0 + TILE, width)
        span = n1 - n0
        acc = np.empty((ROWS, TILE), np.float32)  # acc: [ROWS, TILE] f32, this thread's
        for r0 in range(0, n_rows, ROWS):
            rn = min(ROWS, n_rows - r0)
            quads = rn - rn % 4
            acc[:rn, :span] = 0
            for k in range(depth):
                w_row = wt[k, n0:n1]  # w_row: [span] f32
                for r in range(0, quads, 4):
                    x0, x1 = x[xi[r0 + r], k], x[xi[r0 + r + 1], k]
                    x2, x3 = x[xi[r0 + r + 2], k], x[xi[r0 + r + 3], k]
                    a0, a1, a2, a3 = acc[r], acc[r + 1], acc[r + 2], acc[r + 3]
                    for n in range(span):
                        w = w_row[n]
                        a0[n] = a0[n] + x0 * w
                        a1[n] = a1[n] + x1 * w
                        a2[n] = a2[n] + x2 * w
                        a3[n] = a3[n] + x3 * w
                for r in range(quads, rn):
                    xv = x[xi[r0 + r], k]
                    a = acc[r]
                    for n in range(span):
                        a[n] = a[n] + xv * w_row[n]
            for r in range(rn):
                dst = out[oi[r0 + r]]
                for n in range(span):
                    dst[n0 + n] = acc[r, n]


@njit(cache=True, nogil=True, boundscheck=False)
def step_times(x: np.ndarray, wt: np.ndarray, out: np.ndarray, block: int, once_bytes: int,
               idx: np.ndarray) -> None:  # pragma: no cover - compiled
    """out [n, N] = x [n, K] @ wt [K, N], bitwise :func:`~kernels.model.rowwise.rows_times`: through
    :func:`gather_times` when the weights are past ``once_bytes`` (read once for all rows), else
    ``rows_times`` (``block`` columns at a time). ``idx``: at least n row indices 0, 1, ..."""
    n = x.shape[0]
    if wt.size * 4 > once_bytes:
        gather_times(x, idx[:n], wt, out, idx[:n])
    else:
        rows_times(x, wt, out, block)


@njit(cache=True, nogil=True, boundscheck=False, parallel=True)
def heads_once(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out [n, H, N] = x [n, H, K] @ w [H, K, N] per head, k ascending per element (bitwise
    :func:`~kernels.model.rowwise.heads_times`), each head's weights read once for all rows;
    heads split across threads."""
    n_rows, heads, depth = x.shape
    width = w.shape[2]
    for h in prange(heads):
        for b in range(n_rows):
            out[b, h, :] = 0
        for k in range(depth):
            w_row = w[h, k]  # w_row: [N] f32
            for b in range(n_rows):
                xv = x[b, h, k]
                acc = out[b, h]  # acc: [N] f32
                for n in range(width):
                    acc[n] = acc[n] + xv * w_row[n]


@njit(cache=True, nogil=True, boundscheck=False)
def heads_step(x: np.ndarray, w: np.ndarray, out: np.ndarray, once_bytes: int) -> None:  # pragma: no cover
    """:func:`heads_once` when w [H, K, N] is past ``once_bytes``, else ``heads_times`` (same bits)."""
    if w.size * 4 > once_bytes:
        heads_once(x, w, out)
    else:
        heads_times(x, w, out)


__all__ = ["ROWS", "TILE", "gather_times", "heads_once", "heads_step", "step_times"]
