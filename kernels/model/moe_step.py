"""The routed experts of a batch-invariant MoE in two compiled calls for the whole batch, where
routing expert by expert costs a dozen numpy and kernel calls per expert in use (a batch of 16
on 8 experts uses them all; one row uses its k).

Every (row, chosen expert) pair is one product chain, with the arithmetic of
:func:`kernels.model.rowwise.rowwise_linear`'s kernel per output element (k ascending, a multiply
then an add, from 0): gate and up, ``silu(gate) * up`` in numpy (elementwise), then down. The pairs
run sorted by expert, so consecutive pairs reuse that expert's weights from cache. A row's
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

@njit(void(_A2, _I64, _I64, _A3, _A3, _A2, _A2), cache=True, nogil=True, boundscheck=False)
def _gate_up(x: np.ndarray, rows: np.ndarray, experts: np.ndarray, gate_t: np.ndarray, up_t: np.ndarray,
             g: np.ndarray, u: np.ndarray) -> None:  # pragma: no cover - compiled
    """g[p], u[p] [I] = x[rows[p]] [hidden] @ gate_t / up_t [experts[p]] [hidden, I]."""
    depth = x.shape[1]
    width = g.shape[1]
    for p in range(rows.shape[0]):
        r, e = rows[p], experts[p]
        acc_g, acc_u = g[p], u[p]
        acc_g[:] = 0
        acc_u[:] = 0
        for k in range(depth):
            xv = x[r, k]
            wg, wu = gate_t[e, k], up_t[e, k]  # [I] f32 each
            for n in range(width):
                acc_g[n] = acc_g[n] + xv * wg[n]
                acc_u[n] = acc_u[n] + xv * wu[n]


@njit(void(_A2, _I64, _A3, _A2), cache=True, nogil=True, boundscheck=False)
def _down(h: np.ndarray, experts: np.ndarray, down_t: np.ndarray, y: np.ndarray) -> None:  # pragma: no cover
    """y[p] [hidden] = h[p] [I] @ down_t[experts[p]] [I, hidden]."""
    depth = h.shape[1]
    width = y.shape[1]
    for p in range(h.shape[0]):
        e = experts[p]
        acc = y[p]
        acc[:] = 0
        for k in range(depth):
            hv = h[p, k]
            w = down_t[e, k]  # [hidden] f32
            for n in range(width):
                acc[n] = acc[n] + hv * w[n]


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
