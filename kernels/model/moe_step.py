"""The routed experts of a batch-invariant MoE in two compiled calls for the whole batch, where
routing expert by expert costs a dozen numpy and kernel calls per expert in use (a batch of 16
on 8 experts uses them all; one row uses its k).

Every (row, chosen expert) pair is one product chain, with the arithmetic of
:func:`kernels.model.rowwise.rowwise_linear`'s kernel per output element (k ascending, a multiply
then an add, from 0): gate and up, ``silu(gate) * up`` in numpy (elementwise), then down. The pairs
run sorted by expert, and four consecutive pairs of one expert share each weight load (each
element's chain is the same whichever pairs share the loop). A row's
experts are then summed in ascending expert order, as :class:`~kernels.model.moe.MoE` does. So
every value is bitwise what the expert-by-expert path gives, whoever shares the batch.

It serves experts whose weights take the kernel path of ``rowwise_linear`` (each block of
``COLUMN_BLOCK`` columns within ``L2_WEIGHTS``); larger experts keep the expert-by-expert path,
whose products are BLAS matrix-vector products there.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numba import njit, types, void

from kernels.compile_notice import announce_if_cold
from kernels.model.rowwise import COLUMN_BLOCK, L2_WEIGHTS

_A2, _A3 = types.Array(types.float32, 2, "C"), types.Array(types.float32, 3, "C")
_I64 = types.Array(types.int64, 1, "C")


announce_if_cold(__file__)  # numba compiles the kernels below now unless cached

@njit(types.int64(_I64, types.int64), cache=True, nogil=True, boundscheck=False, inline="always")
def _run_end(experts: np.ndarray, p: int) -> int:  # pragma: no cover - compiled
    """The end of the run of pairs from ``p`` that share ``experts[p]`` (pairs are sorted by expert)."""
    q = p + 1
    while q < experts.shape[0] and experts[q] == experts[p]:
        q += 1
    return q


@njit(void(_A2, _I64, _I64, _A3, _A3, _A2, _A2), cache=True, nogil=True, boundscheck=False)
def _gate_up(x: np.ndarray, rows: np.ndarray, experts: np.ndarray, gate_t: np.ndarray, up_t: np.ndarray,
             g: np.ndarray, u: np.ndarray) -> None:  # pragma: no cover - compiled
    """g[p], u[p] [I] = x[rows[p]] [hidden] @ gate_t / up_t [experts[p]] [hidden, I]. Four pairs
    of one expert share each weight load while four remain in its run: each element's sum is
    the same chain of multiplies and adds, k ascending, whichever pairs share the loop."""
    depth = x.shape[1]
    width = g.shape[1]
    n_pairs = rows.shape[0]
    p = 0
    while p < n_pairs:
        end = _run_end(experts, p)
        e = experts[p]
        while p + 4 <= end:
            r0, r1, r2, r3 = rows[p], rows[p + 1], rows[p + 2], rows[p + 3]
            g0, g1, g2, g3 = g[p], g[p + 1], g[p + 2], g[p + 3]  # [I] f32 each
            u0, u1, u2, u3 = u[p], u[p + 1], u[p + 2], u[p + 3]  # [I] f32 each
            for acc in (g0, g1, g2, g3, u0, u1, u2, u3):
                acc[:] = 0
            for k in range(depth):
                x0, x1, x2, x3 = x[r0, k], x[r1, k], x[r2, k], x[r3, k]
                wg, wu = gate_t[e, k], up_t[e, k]  # [I] f32 each
                for n in range(width):
                    a, b = wg[n], wu[n]
                    g0[n] = g0[n] + x0 * a
                    g1[n] = g1[n] + x1 * a
                    g2[n] = g2[n] + x2 * a
                    g3[n] = g3[n] + x3 * a
                    u0[n] = u0[n] + x0 * b
                    u1[n] = u1[n] + x1 * b
                    u2[n] = u2[n] + x2 * b
                    u3[n] = u3[n] + x3 * b
            p += 4
        while p < end:  # the run's last pairs, one at a time
            r = rows[p]
            acc_g, acc_u = g[p], u[p]  # [I] f32 each
            acc_g[:] = 0
            acc_u[:] = 0
            for k in range(depth):
                xv = x[r, k]
                wg, wu = gate_t[e, k], up_t[e, k]  # [I] f32 each
                for n in range(width):
                    acc_g[n] = acc_g[n] + xv * wg[n]
                    acc_u[n] = acc_u[n] + xv * wu[n]
            p += 1


@njit(void(_A2, _I64, _A3, _A2), cache=True, nogil=True, boundscheck=False)
def _down(h: np.ndarray, experts: np.ndarray, down_t: np.ndarray, y: np.ndarray) -> None:  # pragma: no cover
    """y[p] [hidden] = h[p] [I] @ down_t[experts[p]] [I, hidden]; four pairs of one expert share
    each weight load while four remain in its run."""
    depth = h.shape[1]
    width = y.shape[1]
    n_pairs = h.shape[0]
    p = 0
    while p < n_pairs:
        end = _run_end(experts, p)
        e = experts[p]
        while p + 4 <= end:
            p1, p2, p3 = p + 1, p + 2, p + 3
            y0, y1, y2, y3 = y[p], y[p1], y[p2], y[p3]  # [hidden] f32 each
            for acc in (y0, y1, y2, y3):
                acc[:] = 0
            for k in range(depth):
                h0, h1, h2, h3 = h[p, k], h[p1, k], h[p2, k], h[p3, k]
                w = down_t[e, k]  # [hidden] f32
                for n in range(width):
                    wn = w[n]
                    y0[n] = y0[n] + h0 * wn
                    y1[n] = y1[n] + h1 * wn
                    y2[n] = y2[n] + h2 * wn
                    y3[n] = y3[n] + h3 * wn
            p += 4
        while p < end:  # the run's last pairs, one at a time
            acc = y[p]  # [hidden] f32
            acc[:] = 0
            for k in range(depth):
                hv = h[p, k]
                w = down_t[e, k]  # [hidden] f32
                for n in range(width):
                    acc[n] = acc[n] + hv * w[n]
            p += 1


class StackedExperts:
    """The routed experts' weights stacked and transposed once: gate_t, up_t [E, hidden, I] and
    down_t [E, I, hidden] f32, contiguous."""

    def __init__(self, experts: Sequence[Any]) -> None:
        self.gate_t = np.ascontiguousarray(np.stack([e.gate.T for e in experts]), dtype=np.float32)
        self.up_t = np.ascontiguousarray(np.stack([e.up.T for e in experts]), dtype=np.float32)
        self.down_t = np.ascontiguousarray(np.stack([e.down.T for e in experts]), dtype=np.float32)

    @staticmethod
    def fits(experts: Sequence[Any]) -> bool:
        """Whether every expert's products take rowwise_linear's kernel path (same shapes for all)."""
        return bool(experts) and all(w.shape[1] * COLUMN_BLOCK * 4 <= L2_WEIGHTS
                                     for e in experts for w in (e.gate, e.up, e.down))

    def __call__(self, x: np.ndarray, weights: np.ndarray, chosen: np.ndarray,
                 silu: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """x [N, hidden] f32, routing weights [N, k] f32 and experts [N, k] i64 -> the routed
        experts' weighted sum [N, hidden] f32, a row's experts added in ascending expert order."""
        n, k = chosen.shape
        xs = np.ascontiguousarray(x, dtype=np.float32)  # xs: [N, hidden] f32
        flat = chosen.reshape(-1).astype(np.int64)  # flat: [N*k] expert of pair (row, slot)
        by_expert = np.argsort(flat, kind="stable")  # by_expert: [P] pairs sorted by expert
        rows = np.ascontiguousarray(by_expert // k, dtype=np.int64)  # rows: [P] i64
        experts = np.ascontiguousarray(flat[by_expert])  # experts: [P] i64
        width = self.gate_t.shape[2]
        g = np.empty((rows.shape[0], width), np.float32)  # g: [P, I] f32
        u = np.empty((rows.shape[0], width), np.float32)  # u: [P, I] f32
        _gate_up(xs, rows, experts, self.gate_t, self.up_t, g, u)
        h = np.ascontiguousarray(silu(g) * u)  # h: [P, I] f32
        y = np.empty((rows.shape[0], xs.shape[1]), np.float32)  # y: [P, hidden] f32
        _down(h, experts, self.down_t, y)
        where = np.empty(n * k, np.int64)  # where: [N*k] sorted index of pair (row, slot)
        where[by_expert] = np.arange(n * k)
        where = where.reshape(n, k)
        ascending = np.argsort(chosen, axis=1, kind="stable")  # ascending: [N, k] slots by expert
        every = np.arange(n)
        out = np.zeros_like(xs)  # out: [N, hidden] f32
        for j in range(k):
            slot = ascending[:, j]  # slot: [N]
            out += y[where[every, slot]] * weights[every, slot][:, None]
        return out


__all__ = ["StackedExperts"]
