"""The feed-forward blocks of the compiled step (:mod:`kernels.model.compiled_step`) in compiled
code: the dense SwiGLU MLP over a step's rows, and the MoE (the router of each row, the routed
experts expert by expert, up to four of its rows sharing each weight tile, the shared expert).

Bitwise :mod:`kernels.model.moe`'s batch-invariant path: every product element is the same
k-ascending chain from 0 as :func:`kernels.model.rowwise.rows_times` (whichever rows share a
loop), SiLU and the router's sigmoid use numpy's float32 exp (:mod:`kernels.model.step_math`),
the router's choices follow ``route`` (stable orders: ties to the lower index), and a row's
experts are added in ascending expert order from 0.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from kernels.model.once_product import TILE_ROWS_FROM, packed_times, paneled_layout, step_times
from kernels.model.step_math import sigmoid_f32, silu_f32

_F32 = np.float32




@njit(cache=True, nogil=True, boundscheck=False)
def route_row(logits: np.ndarray, bias: np.ndarray, n_group: int, topk_group: int, norm: bool, scale: np.float32,
              scores: np.ndarray, choice: np.ndarray, group: np.ndarray, chosen: np.ndarray,
              weights: np.ndarray) -> None:  # pragma: no cover - compiled
    """One row's router (:func:`kernels.model.moe.route`): logits [E] -> its experts ``chosen`` [k]
    ascending and their ``weights`` [k] f32 in that order."""
    n_exp, k = logits.shape[0], chosen.shape[0]
    per = n_exp // n_group
    for e in range(n_exp):
        scores[e] = sigmoid_f32(logits[e])
        choice[e] = scores[e] + bias[e]
    for g in range(n_group):  # the sum of each group's two best (a sorted copy's first two)
        t1, t2 = -np.inf, -np.inf
        for e in range(g * per, g * per + per):
            v = choice[e]
            if v > t1:
                t1, t2 = v, t1
            elif v > t2:
                t2 = v
        group[g] = t1 + t2
    for _ in range(topk_group):  # the best groups, ties to the lower index; a taken one becomes NaN
        best = -1
        for g in range(n_group):
            if group[g] == group[g] and (best < 0 or group[g] > group[best]):
                best = g
        group[best] = np.nan
    for e in range(n_exp):
        if group[e // per] == group[e // per]:  # a group not taken
            choice[e] = -np.inf
    for j in range(k):  # the k best, ties to the lower index; a taken one becomes NaN
        best = -1
        for e in range(n_exp):
            if choice[e] == choice[e] and (best < 0 or choice[e] > choice[best]):
                best = e
        chosen[j] = best
        choice[best] = np.nan
    total = _F32(0.0)
    for j in range(k):
        weights[j] = scores[chosen[j]]
        total = total + weights[j]
    if norm:
        total = total + _F32(1e-20)
        for j in range(k):
            weights[j] = weights[j] / total
    for j in range(k):
        weights[j] = weights[j] * scale
    for j in range(1, k):  # ascending experts, as the reference adds them (insertion sort, k is small)
        c, wj = chosen[j], weights[j]
        i = j - 1
        while i >= 0 and chosen[i] > c:
            chosen[i + 1], weights[i + 1] = chosen[i], weights[i]
            i -= 1
        chosen[i + 1], weights[i + 1] = c, wj


@njit(cache=True, nogil=True, boundscheck=False)
def mlp_rows(x: np.ndarray, gate_t: np.ndarray, up_t: np.ndarray, down_t: np.ndarray, blocks: np.ndarray,
             g: np.ndarray, u: np.ndarray, out: np.ndarray, once: int,
             idx: np.ndarray) -> None:  # pragma: no cover - compiled
    """out [n, D] = down(silu(gate(x)) * up(x)) over rows x [n, D]; g, u [n, I] scratch; weights
    past ``once`` bytes read once for all rows (``idx``: 0, 1, .. at least n)."""
    step_times(x, gate_t, g, blocks[0], once, idx)
    step_times(x, up_t, u, blocks[0], once, idx)
    for b in range(g.shape[0]):
        for i in range(g.shape[1]):
            g[b, i] = silu_f32(g[b, i]) * u[b, i]
    step_times(g, down_t, out, blocks[1], once, idx)


@njit(cache=True, nogil=True, boundscheck=False)
def _expert_once(x: np.ndarray, gate_t: np.ndarray, up_t: np.ndarray, down_t: np.ndarray, pairs: np.ndarray,
                 k: int, prow: np.ndarray, idx: np.ndarray, g: np.ndarray, u: np.ndarray,
                 y: np.ndarray, once: int) -> None:  # pragma: no cover - compiled
    """One expert over its pairs (pair p = row p // k, slot p % k): y[p] [D] = down(silu(gate(x)) *
    up(x)) of that row, every element the same k-ascending chain from 0 whichever pairs share the
    products (kernels.model.moe_step's rule), each product
    :func:`kernels.model.once_product.packed_times` (register tiles over panels, the weights read
    once for all the expert's pairs; threads past ``once`` bytes). prow [cnt] scratch (each pair's
    row), g, u [cnt, I]."""
    cnt = pairs.shape[0]
    for q in range(cnt):
        prow[q] = pairs[q] // k
    packed_times(x, prow[:cnt], gate_t, g, idx[:cnt], once)
    packed_times(x, prow[:cnt], up_t, u, idx[:cnt], once)
    for q in range(cnt):
        for i in range(g.shape[1]):
            g[q, i] = silu_f32(g[q, i]) * u[q, i]
    packed_times(g, idx[:cnt], down_t, y, pairs, once)


@njit(cache=True, nogil=True, boundscheck=False)
def _expert_pairs(x: np.ndarray, gate_t: np.ndarray, up_t: np.ndarray, down_t: np.ndarray, pairs: np.ndarray,
                  k: int, g: np.ndarray, u: np.ndarray, y: np.ndarray) -> None:  # pragma: no cover - compiled
    """One expert over its pairs (pair p = row p // k, slot p % k): y[p] [D] = down(silu(gate(x)) *
    up(x)) of that row. Four pairs share each weight load while four remain; every element is the
    same k-ascending chain from 0 whichever pairs share the loop (kernels.model.moe_step's rule).
    g, u [4, I] scratch."""
    depth, inner = x.shape[1], g.shape[1]
    cnt = pairs.shape[0]
    p = 0
    while p < cnt:
        group = min(4, cnt - p)
        g[:group] = 0
        u[:group] = 0
        if group == 4:
            r0, r1, r2, r3 = pairs[p] // k, pairs[p + 1] // k, pairs[p + 2] // k, pairs[p + 3] // k
            for kk in range(depth):
                x0, x1, x2, x3 = x[r0, kk], x[r1, kk], x[r2, kk], x[r3, kk]
                for i in range(inner):
                    a, b = gate_t[kk, i], up_t[kk, i]
                    g[0, i] = g[0, i] + x0 * a
                    g[1, i] = g[1, i] + x1 * a
                    g[2, i] = g[2, i] + x2 * a
                    g[3, i] = g[3, i] + x3 * a
                    u[0, i] = u[0, i] + x0 * b
                    u[1, i] = u[1, i] + x1 * b
                    u[2, i] = u[2, i] + x2 * b
                    u[3, i] = u[3, i] + x3 * b
        else:
            for q in range(group):
                r = pairs[p + q] // k
                for kk in range(depth):
                    xv = x[r, kk]
                    for i in range(inner):
                        g[q, i] = g[q, i] + xv * gate_t[kk, i]
                        u[q, i] = u[q, i] + xv * up_t[kk, i]
        for q in range(group):
            for i in range(inner):
                g[q, i] = silu_f32(g[q, i]) * u[q, i]
            y[pairs[p + q], :] = 0
        width = y.shape[1]
        if group == 4:
            y0, y1, y2, y3 = y[pairs[p]], y[pairs[p + 1]], y[pairs[p + 2]], y[pairs[p + 3]]
            for kk in range(inner):
                h0, h1, h2, h3 = g[0, kk], g[1, kk], g[2, kk], g[3, kk]
                for i in range(width):
                    wv = down_t[kk, i]
                    y0[i] = y0[i] + h0 * wv
                    y1[i] = y1[i] + h1 * wv
                    y2[i] = y2[i] + h2 * wv
                    y3[i] = y3[i] + h3 * wv
        else:
            for q in range(group):
                yq = y[pairs[p + q]]
                for kk in range(inner):
                    hv = g[q, kk]
                    for i in range(width):
                        yq[i] = yq[i] + hv * down_t[kk, i]
        p += group


@njit(cache=True, nogil=True, boundscheck=False)
def moe_rows(x: np.ndarray, router_t: np.ndarray, bias: np.ndarray, e_gate: np.ndarray, e_up: np.ndarray,
             e_down: np.ndarray, sh_gate: np.ndarray, sh_up: np.ndarray, sh_down: np.ndarray, m: int,
             dims: np.ndarray, fdims: np.ndarray, logits: np.ndarray, scores: np.ndarray, choice: np.ndarray,
             group: np.ndarray, chosen: np.ndarray, weights: np.ndarray, eg: np.ndarray, eu: np.ndarray,
             ey: np.ndarray, sg: np.ndarray, su: np.ndarray, so: np.ndarray, picked: np.ndarray,
             picked_w: np.ndarray, pairs: np.ndarray, n: int, out: np.ndarray, big: Any) -> None:  # pragma: no cover
    """out [n, D] = MoE layer m of rows x [n, D]: routed experts (ascending) plus the shared one
    (weights: the packed ``moe`` tuple's; the rest: the scratch's router and expert arrays:
    ``picked``, ``picked_w`` [n, k] each row's experts and weights, ``ey`` [n*k, D] each pair's
    output, ``pairs`` [n*k] one expert's pairs; eg, eu: unused). ``big``: (once, idx, prow, ga,
    ua): weights past ``once`` bytes read once per step (:mod:`kernels.model.once_product`), idx
    [n*k] 0, 1, .., prow [n*k] i64 and ga, ua [n*k, I] f32 scratch."""
    once, idx, prow, ga, ua = big
    k = chosen.shape[0]
    step_times(x, router_t[m], logits[:n], dims[22], once, idx)
    for b in range(n):
        route_row(logits[b], bias[m], dims[12], dims[13], dims[14] != 0, fdims[3], scores, choice, group, chosen,
               weights)
        for j in range(k):
            picked[b, j], picked_w[b, j] = chosen[j], weights[j]
    plain = not (paneled_layout(e_gate.shape[3]) or paneled_layout(e_down.shape[3]))  # both in [K, N] order
    for e in range(dims[10]):  # expert by expert, the rows that chose it
        cnt = 0
        for b in range(n):
            for j in range(k):
                if picked[b, j] == e:
                    pairs[cnt] = b * k + j
                    cnt += 1
        if cnt >= TILE_ROWS_FROM or (cnt and (e_gate[m, e].size * 4 > once or not plain)):
            _expert_once(x, e_gate[m, e], e_up[m, e], e_down[m, e], pairs[:cnt], k, prow, idx, ga[:cnt], ua[:cnt],
                         ey, once)
        elif cnt:  # fewer pairs than a register tile's rows, weights in [K, N] order: the plain loops (the same chains)
            _expert_pairs(x, e_gate[m, e], e_up[m, e], e_down[m, e], pairs[:cnt], k, eg, eu, ey)
    for b in range(n):  # a row's experts added in ascending expert order (picked ascends)
        out[b, :] = 0
        for j in range(k):
            wj, yp = picked_w[b, j], ey[b * k + j]
            for i in range(out.shape[1]):
                out[b, i] = out[b, i] + yp[i] * wj
    mlp_rows(x, sh_gate[m], sh_up[m], sh_down[m], dims[23:25], sg[:n], su[:n], so[:n], once, idx)
    for b in range(n):
        for i in range(out.shape[1]):
            out[b, i] = out[b, i] + so[b, i]


__all__ = ["mlp_rows", "moe_rows", "route_row"]
