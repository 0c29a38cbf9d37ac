"""Batch-invariant matrix products for the decode step: row b of a batched product is bitwise
what row b alone gives, whatever else shares the batch and however large it is.

Why not BLAS: a GEMM picks its kernels, blockings and thread splits by the problem's shape, and a
row's result depends on them. Measured with numpy's OpenBLAS: ``x[B, K] @ W`` rows differ from the
rows computed alone by up to 4e-5, and a GEMM padded to a fixed 16 rows still differs by the row's
position in the block (11 of 12 decoder shapes, single-threaded). A stacked ``[B, 1, K]`` matmul
is invariant (one GEMV per row) but reads the weights once per row, so a batch (or a prefill
chunk) of B rows costs B lone rows: useless for a step that batches sessions or prompt tokens.

So these kernels fix the arithmetic per output element by construction: ``out[b, n]`` is
``((0 + x[b, 0] * w[0, n]) + x[b, 1] * w[1, n]) + ...``, k ascending, a multiply then an add (no
fused multiply-add, no reassociation: numba's default strict IEEE mode), the same sequence for
every b and every B. Only the loop order is chosen for speed: four rows at a time accumulate a
block of output columns while the weight rows stream past (each weight read once per four
rows), the block sized by the weights alone (:func:`column_block`: narrow while a block's weights
stay in L2, wide contiguous runs past that), and the innermost loop runs along n (independent
elements, so the compiler vectorises it without reordering any sum).
Weights larger than ``THREADED_BYTES`` (GLM-5.2's projections) are kept as
panels [P, K, 16] (:func:`paneled`, 16 output columns each, contiguous, one L2-resident panel at a
time) and multiplied with the panels split across threads: every weight is read from memory once
for the whole batch, and each element is still one thread's k-ascending sum (measured here on a
12288 x 6144 weight: one row 22 ms vs 12 ms for BLAS's threaded GEMV, 16 rows 60 ms vs 196 ms).
No GIL held (numba: a well-kept JIT, so the kernels are plain Python loops here rather than C;
compiled once and cached next to this module).

The weights are used as ``[in, out]`` (the transpose of a checkpoint's ``[out, in]``), made
contiguous once per weight array and kept while the array lives (:func:`transposed`).
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit, prange, types, void

from kernels.compile_notice import announce_if_cold

COLUMN_BLOCK = 256  # output columns per block while the block's weights fit L2 (16 rows x 256 f32 in L1)
WIDE_BLOCK = 4096  # past that, long contiguous weight runs (a 1 KiB run per 4 KiB page thrashes the TLB)
L2_WEIGHTS = 512 << 10  # bytes of one block's weights [K, block] that stay in L2 for every row group


def column_block(depth: int, width: int) -> int:
    """Output columns per block for weights [depth, width]: a function of the weights alone, so
    a row's arithmetic (which the block never changes) and its speed are the same for any batch."""
    block = COLUMN_BLOCK if depth * COLUMN_BLOCK * 4 <= L2_WEIGHTS else WIDE_BLOCK
    return max(1, min(block, width))


def _signatures(ndim: int, *extra: Any) -> list[Any]:
    """out is ours (writable); x and the weights may be read-only (a checkpoint's memory map)."""
    writable, readonly = types.Array(types.float32, ndim, "C"), types.Array(types.float32, ndim, "C", readonly=True)
    return [void(x, w, writable, *extra) for x in (writable, readonly) for w in (writable, readonly)]


announce_if_cold(__file__)  # numba compiles the kernels below now unless cached

@njit(_signatures(2, types.int64), cache=True, nogil=True, boundscheck=False)
def _rows_times(x: np.ndarray, wt: np.ndarray, out: np.ndarray, block: int) -> None:  # pragma: no cover
    """out [B, N] = x [B, K] @ wt [K, N], k ascending per element; four rows share each weight load."""
    n_rows, depth = x.shape
    width = wt.shape[1]
    quads = n_rows - n_rows % 4
    for n0 in range(0, width, block):
        n1 = min(n0 + block, width)
        for b in range(0, quads, 4):
            a0, a1, a2, a3 = out[b, n0:n1], out[b + 1, n0:n1], out[b + 2, n0:n1], out[b + 3, n0:n1]
            a0[:] = 0
            a1[:] = 0
            a2[:] = 0
            a3[:] = 0
            for k in range(depth):
                x0, x1, x2, x3 = x[b, k], x[b + 1, k], x[b + 2, k], x[b + 3, k]
                w_row = wt[k, n0:n1]  # w_row: [n1 - n0] f32
                for n in range(n1 - n0):
                    w = w_row[n]
                    a0[n] = a0[n] + x0 * w
                    a1[n] = a1[n] + x1 * w
                    a2[n] = a2[n] + x2 * w
                    a3[n] = a3[n] + x3 * w
        for b in range(quads, n_rows):
            acc = out[b, n0:n1]  # acc: [n1 - n0] f32, in L1
            acc[:] = 0
            for k in range(depth):
                xv = x[b, k]
                w_row = wt[k, n0:n1]
                for n in range(n1 - n0):
                    acc[n] = acc[n] + xv * w_row[n]


@njit(_signatures(3), cache=True, nogil=True, boundscheck=False)
def _heads_times(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out [B, H, N] = x [B, H, K] @ w [H, K, N] per head, k ascending per element."""
    n_rows, heads, depth = x.shape
    width = w.shape[2]
    for b in range(n_rows):
        for h in range(heads):
            acc = out[b, h]  # acc: [N] f32
            acc[:] = 0
            for k in range(depth):
                xv = x[b, h, k]
                w_row = w[h, k]  # w_row: [N] f32
                for n in range(width):
                    acc[n] = acc[n] + xv * w_row[n]


rows_times = _rows_times  # the compiled step (kernels.model.compiled_step) calls these inside its own kernel
heads_times = _heads_times

PANEL = 16  # output columns of one panel: one 64-byte run of a weight row; a [K, 16] panel stays in L2
THREADED_BYTES = 8 << 20  # weights larger than this repay the panel kernel's threads (smaller: thread wake-ups
# dominate, and on a busy machine a parallel region waits for a core; measured on glm-mini's shapes)


@njit([void(x, p, types.Array(types.float32, 2, "C")) for x in (types.Array(types.float32, 2, "C"),
                                                             types.Array(types.float32, 2, "C", readonly=True))
       for p in (types.Array(types.float32, 3, "C"),)], cache=True, nogil=True, parallel=True,
      boundscheck=False)
def _panels_times(x: np.ndarray, panels: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out [B, N] = x [B, K] @ W, W given as panels [P, K, PANEL] (columns p*PANEL.. of W, zero-padded),
    k ascending per element; panels split across threads (each element is one thread's), four
    rows share each weight load while the panel stays in L2."""
    n_rows, depth = x.shape
    n_panels, width = panels.shape[0], out.shape[1]
    quads = n_rows - n_rows % 4
    for pi in prange(n_panels):
        n0 = pi * PANEL
        n1 = min(n0 + PANEL, width)
        acc = np.empty((4, PANEL), np.float32)  # acc: [4, PANEL] f32, this thread's
        for b in range(0, quads, 4):
            acc[:] = 0
            for k in range(depth):
                x0, x1, x2, x3 = x[b, k], x[b + 1, k], x[b + 2, k], x[b + 3, k]
                for n in range(PANEL):
                    w = panels[pi, k, n]
                    acc[0, n] = acc[0, n] + x0 * w
                    acc[1, n] = acc[1, n] + x1 * w
                    acc[2, n] = acc[2, n] + x2 * w
                    acc[3, n] = acc[3, n] + x3 * w
            for r in range(4):
                for n in range(n1 - n0):
                    out[b + r, n0 + n] = acc[r, n]
        for b in range(quads, n_rows):
            acc[0, :] = 0
            for k in range(depth):
                xv = x[b, k]
                for n in range(PANEL):
                    acc[0, n] = acc[0, n] + xv * panels[pi, k, n]
            for n in range(n1 - n0):
                out[b, n0 + n] = acc[0, n]


_lock = threading.Lock()
_layouts: dict[tuple[str, int], tuple[weakref.ref[np.ndarray], np.ndarray]] = {}  # (layout, id(w)) -> (w, copy)
# keys whose weight died, dropped at the next look-up: a weakref callback must not take ``_lock``, since
# a garbage collection may run it on a thread that holds it (any allocation inside the lock can collect)
_dead: list[tuple[tuple[str, int], weakref.ref[np.ndarray]]] = []


def _drop_dead() -> None:
    """Forget the layouts of weights that died (under ``_lock``)."""
    while _dead:
        key, ref = _dead.pop()
        if _layouts.get(key, (None,))[0] is ref:
            del _layouts[key]


def _kept_layout(w: np.ndarray, layout: str, make: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``make(w)``, made once per weight array and layout and kept while ``w`` lives."""
    key = (layout, id(w))
    with _lock:
        _drop_dead()
        held = _layouts.get(key)
        if held is not None and held[0]() is w:
            return held[1]
    made = make(w)

    def forget(ref: weakref.ref[np.ndarray], key: tuple[str, int] = key,
               dead: list[Any] = _dead) -> None:  # bound now: also at interpreter exit; takes no lock
        dead.append((key, ref))

    with _lock:
        _drop_dead()
        _layouts[key] = (weakref.ref(w, forget), made)
    return made


def transposed(w: np.ndarray) -> np.ndarray:
    """w [..., out, in] as a contiguous f32 [..., in, out] (the last two axes swapped), made once and
    kept while ``w`` lives."""
    return _kept_layout(w, "transposed", lambda v: np.ascontiguousarray(np.swapaxes(v, -1, -2), dtype=np.float32))


def paneled(w: np.ndarray) -> np.ndarray:
    """w [out, in] as contiguous f32 panels [ceil(out / PANEL), in, PANEL] (panel p holds columns
    p*PANEL.. of w^T, the last zero-padded), made once and kept while ``w`` lives."""
    return _kept_layout(w, "panels", _panels_of)


def _panels_of(w: np.ndarray) -> np.ndarray:
    out_dim, in_dim = w.shape
    n_panels = -(-out_dim // PANEL)
    padded = np.zeros((n_panels * PANEL, in_dim), np.float32)  # padded: [P*PANEL, in] f32
    padded[:out_dim] = w
    return np.ascontiguousarray(padded.reshape(n_panels, PANEL, in_dim).transpose(0, 2, 1))  # [P, in, PANEL]


def rowwise_linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [B, in] @ w[out, in]^T -> [B, out] f32, batch-invariant.

    Weights of up to ``THREADED_BYTES`` go through the single-threaded kernel; larger ones through the
    panel kernel (:func:`paneled` weights, the panels split across threads, each panel read from
    memory once for all the rows): the same arithmetic per element, so a batch of 16 costs about
    what a lone row does until the step turns compute-bound. The choice depends on the weights'
    shape alone."""
    xs = np.ascontiguousarray(x, dtype=np.float32)  # xs: [B, in] f32
    if w.size * 4 > THREADED_BYTES:
        big = np.empty((xs.shape[0], w.shape[0]), np.float32)  # big: [B, out] f32
        _panels_times(xs, paneled(w), big)
        return big
    wt = transposed(w)  # wt: [in, out] f32
    out = np.empty((xs.shape[0], wt.shape[1]), np.float32)  # out: [B, out] f32
    _rows_times(xs, wt, out, column_block(wt.shape[0], wt.shape[1]))
    return out


def head_matmul(x: np.ndarray, w: np.ndarray, rowwise: bool, *, w_transposed: bool = False) -> np.ndarray:
    """Per-head products x [S, H, a] @ w [H, a, b] -> [S, H, b] f32 (``w_transposed``: w is given
    as [H, b, a]).

    ``rowwise``: batch-invariant (each row and head alone); otherwise one GEMM per head over the
    S rows (a prefill)."""
    if not rowwise:
        wv = w.transpose(0, 2, 1) if w_transposed else w  # wv: [H, a, b]
        y: np.ndarray = np.matmul(x.transpose(1, 0, 2), wv).transpose(1, 0, 2)  # y: [S, H, b]
        return y
    xs = np.ascontiguousarray(x, dtype=np.float32)  # xs: [S, H, a] f32
    ws = transposed(w) if w_transposed else np.ascontiguousarray(w, dtype=np.float32)  # ws: [H, a, b] f32
    out = np.empty((xs.shape[0], xs.shape[1], ws.shape[2]), np.float32)  # out: [S, H, b] f32
    _heads_times(xs, ws, out)
    return out


__all__ = ["COLUMN_BLOCK", "PANEL", "THREADED_BYTES", "column_block", "head_matmul", "heads_times", "paneled",
           "rows_times", "rowwise_linear", "transposed"]
