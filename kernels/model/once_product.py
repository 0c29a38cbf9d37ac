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

Every packed weight a whole number of 16-column panels wide is kept in panel order, the small ones
too (:func:`panel_times` runs them on the step's thread): a tile's k loop then reads one contiguous
run where [K, N] order strides a whole weight row at every k, and glm-mini's step of 16 rows went
from 3.7-3.9 to 3.0-3.4 ms (its lm_head alone 0.59 to 0.21-0.29 ms; BENCHMARKS.md, session 24).

The rows are gathered (``xi``) and scattered (``oi``) by index, so one kernel serves plain rows
(identity indices) and an expert's (row, slot) pairs.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.compile_notice import announce_if_cold
from kernels.model.panel_tiles import GROUP, panel_tiles
from kernels.model.rowwise import PANEL, heads_times, rows_times
from kernels.model.simd_tile import tile_heads, tile_rows

TILE = 256  # output columns per tile (1 KiB of each weight row)
# steps of fewer rows take rows_times / heads_times (the same bits): compiled from a cold cache, the register
# tiles' narrow path made a step of one glm-mini session 1.27 ms against 0.46 (bench.step_rows, fresh NUMBA_CACHE_DIR)
TILE_ROWS_FROM = 4
K_BLOCK = 2048  # k rows of a group's panels that all the rows pass over while they stay in L2 (GROUP x 128 KiB)
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


@njit(cache=True, nogil=True)
def paneled_layout(width: int) -> bool:
    """Whether the compiled step keeps a packed [depth, width] weight's memory in panel order
    (:func:`panel_order`): a whole number of ``PANEL`` columns wide, whatever its size. A weight that
    stays in cache is read faster so too: a 16-column tile's k loop walks one contiguous run, where in
    [K, N] order it strides a whole row (12 KiB for glm-mini's lm_head) at every k."""
    return width % PANEL == 0


def panel_order(wt: np.ndarray) -> np.ndarray:
    """wt [K, N] f32 as :func:`panel_times` reads it where :func:`paneled_layout` says so: the same
    shape, its memory the panels [N / PANEL, K, PANEL] (panel p: columns p*PANEL.. of wt); else wt."""
    depth, width = wt.shape
    if not paneled_layout(width):
        return wt
    panels = wt.reshape(depth, width // PANEL, PANEL).transpose(1, 0, 2)  # [P, K, PANEL]
    return np.ascontiguousarray(panels, dtype=np.float32).reshape(depth, width)


@njit(cache=True, nogil=True, boundscheck=False)
def _panel_group(x: np.ndarray, xi: np.ndarray, wt: np.ndarray, out: np.ndarray, oi: np.ndarray, p0: int,
                 count: int, kb: int) -> None:  # pragma: no cover - compiled
    """The ``count`` panels from panel ``p0`` on of a weight in panel order, for every row: out's
    columns zeroed, then k in blocks of ``kb`` rows, four rows at a time in register tiles
    (:func:`kernels.model.panel_tiles.panel_tiles`, each sum carried on in out between blocks)."""
    n_rows = xi.shape[0]
    depth = wt.shape[0]
    xa, wa, oa = x.ctypes.data, wt.ctypes.data, out.ctypes.data
    xs, os, xk = x.strides[0], out.strides[0], x.strides[1]
    pstride = depth * PANEL * 4  # bytes from one panel to the next
    col = p0 * PANEL * 4  # out's byte offset of the group's first column
    for b in range(n_rows):
        out[oi[b], p0 * PANEL : (p0 + count) * PANEL] = 0  # the chains start from 0
    for k0 in range(0, depth, kb):
        span = min(kb, depth - k0)
        xk0, wk0 = xa + k0 * xk, wa + p0 * pstride + k0 * PANEL * 4  # x's and the panels' row k0
        for b in range(0, n_rows, 4):
            rows = min(4, n_rows - b)
            r0, r1, r2, r3 = xi[b], xi[b + min(1, rows - 1)], xi[b + min(2, rows - 1)], xi[b + rows - 1]
            o0, o1, o2, o3 = oi[b], oi[b + min(1, rows - 1)], oi[b + min(2, rows - 1)], oi[b + rows - 1]
            panel_tiles(rows, (xk0 + r0 * xs, xk0 + r1 * xs, xk0 + r2 * xs, xk0 + r3 * xs),
                        (oa + o0 * os + col, oa + o1 * os + col, oa + o2 * os + col, oa + o3 * os + col),
                        wk0, pstride, xk, span, count, PANEL * 4)


@njit(cache=True, nogil=True, boundscheck=False)
def panel_times(x: np.ndarray, xi: np.ndarray, wt: np.ndarray, out: np.ndarray,
                oi: np.ndarray) -> None:  # pragma: no cover - compiled
    """:func:`gather_panels` on the calling thread, k in one pass: for a weight in panel order that
    stays in cache (glm-mini's), any number of rows. ``oi``'s rows distinct."""
    n_panels = wt.shape[1] // PANEL
    for p0 in range(0, n_panels, GROUP):
        _panel_group(x, xi, wt, out, oi, p0, min(GROUP, n_panels - p0), wt.shape[0])


@njit(cache=True, nogil=True, boundscheck=False, parallel=True)
def gather_panels(x: np.ndarray, xi: np.ndarray, wt: np.ndarray, out: np.ndarray,
                  oi: np.ndarray) -> None:  # pragma: no cover - compiled
    """:func:`gather_times` over a weight in panel order (:func:`panel_order`): ``GROUP`` panels [K, PANEL]
    (contiguous, 24-400 KB each) at a time, read from memory once for all rows, four rows at a time
    summing in vector registers (:func:`kernels.model.panel_tiles.panel_tiles`: a row's sums over
    several panels are independent chains); past four rows, k in blocks of ``K_BLOCK`` (the group's
    block stays in L2 while every row passes, each sum carried on in out between blocks: the same
    chain); groups of panels split across threads. ``oi``'s rows distinct (each is zeroed, then summed)."""
    depth = wt.shape[0]
    n_panels = wt.shape[1] // PANEL
    kb = depth if xi.shape[0] <= 4 else K_BLOCK  # one pass: the whole k range; several: blocks that stay in L2
    for g in prange((n_panels + GROUP - 1) // GROUP):
        p0 = g * GROUP
        _panel_group(x, xi, wt, out, oi, p0, min(GROUP, n_panels - p0), kb)


@njit(cache=True, nogil=True, boundscheck=False)
def packed_times(x: np.ndarray, xi: np.ndarray, wt: np.ndarray, out: np.ndarray, oi: np.ndarray,
                 once_bytes: int) -> None:  # pragma: no cover - compiled
    """out[oi[r]] [N] = x[xi[r]] [K] @ wt [K, N] for each r, wt as :func:`panel_order` left it: in
    panel order, :func:`gather_panels` past ``once_bytes`` (threads), else :func:`panel_times`; in
    [K, N] order, :func:`gather_times` past ``once_bytes``, else
    :func:`kernels.model.simd_tile.tile_rows`. Every way the same bits (``rows_times``'s chains)."""
    big = wt.size * 4 > once_bytes
    if paneled_layout(wt.shape[1]):
        if big:
            gather_panels(x, xi, wt, out, oi)
        else:
            panel_times(x, xi, wt, out, oi)
    elif big:
        gather_times(x, xi, wt, out, oi)
    else:
        tile_rows(x, xi, wt, out, oi, wt.shape[1])


@njit(cache=True, nogil=True, boundscheck=False)
def step_times(x: np.ndarray, wt: np.ndarray, out: np.ndarray, block: int, once_bytes: int,
               idx: np.ndarray) -> None:  # pragma: no cover - compiled
    """out [n, N] = x [n, K] @ wt [K, N], bitwise :func:`~kernels.model.rowwise.rows_times`: through
    :func:`packed_times` when wt is in panel order or past ``once_bytes``, else ``rows_times`` (fewer
    than ``TILE_ROWS_FROM`` rows) or :func:`kernels.model.simd_tile.tile_rows` (``block`` columns at a
    time, the sums held in vector registers). ``idx``: at least n row indices 0, 1, ..."""
    n = x.shape[0]
    if paneled_layout(wt.shape[1]) or wt.size * 4 > once_bytes:
        packed_times(x, idx[:n], wt, out, idx[:n], once_bytes)
    elif n < TILE_ROWS_FROM:
        rows_times(x, wt, out, block)
    else:
        tile_rows(x, idx[:n], wt, out, idx[:n], block)


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
def heads_step(x: np.ndarray, w: np.ndarray, out: np.ndarray, once_bytes: int,
               idx: np.ndarray) -> None:  # pragma: no cover - compiled
    """:func:`heads_once` when w [H, K, N] is past ``once_bytes``, else
    :func:`kernels.model.simd_tile.tile_heads` (``idx``: at least n row indices 0, 1, ..; the same
    bits as ``heads_times``)."""
    if w.size * 4 > once_bytes:
        heads_once(x, w, out)
    elif x.shape[0] < TILE_ROWS_FROM:
        heads_times(x, w, out)
    else:
        tile_heads(x, w, out, idx[: x.shape[0]])


__all__ = ["ROWS", "TILE", "gather_panels", "gather_times", "heads_once", "heads_step", "packed_times", "panel_order",
           "panel_times", "paneled_layout", "step_times"]
