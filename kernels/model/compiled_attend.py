"""The compiled step's attention over fp8 rows (:mod:`kernels.model.compiled_step`): bitwise
:func:`kernels.attention.row_tables.attend_rows` (the reference step's batch kernel), with each
session's context, ``sum_j (p_j * Lsc_j) * row_j`` over its selected rows, taken for all heads at
once by :func:`kernels.model.simd_tile.tile_rows` (the heads share each decoded row; every element
is still ``((0 + w_0 * row_0[n]) + w_1 * row_1[n]) + ...``, rows ascending, a multiply then an add,
as ``attend_one`` gives). Scores, the running max, exp and the sum of p are ``attend_one``'s, in its
order.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit, types

from kernels.attention.row_tables import block_of, pointer_to
from kernels.attention.sparse_step import dot_lanes
from kernels.fp8 import USABLE_SCALE_BOUND
from kernels.model.simd_tile import tile_rows

_BOUND = np.float32(USABLE_SCALE_BOUND)
_u8_at = pointer_to(types.uint8)
_f32_at = pointer_to(types.float32)


@njit(cache=True, nogil=True, boundscheck=False)
def attend_fp8_rows(qa: np.ndarray, qr: np.ndarray, tables: np.ndarray, sel: np.ndarray, counts: np.ndarray,
                    table: np.ndarray, scale: np.float32, ctx: np.ndarray) -> None:  # pragma: no cover - compiled
    """ctx [B, H, K] f32: session b's queries qa [B, H, K], qr [B, H, R] over its rows sel[b, :counts[b]]
    (ascending positions) of its fp8 blocks, tables [B, NB, LATENT_FIELDS], decoded through ``table``
    (DECODE_TABLE [256] f32) with sanitised scales (``0 < s < bound`` else 0)."""
    heads, width, rope = qa.shape[1], qa.shape[2], qr.shape[2]
    k_max = sel.shape[1]
    lc_f = np.empty((k_max, width), np.float32)  # lc_f: [k, K] f32, one session's decoded rows
    rc_f = np.empty((k_max, rope), np.float32)  # rc_f: [k, R] f32
    lsc = np.empty(k_max, np.float32)  # lsc: [k] f32 sanitised scales
    rsc = np.empty(k_max, np.float32)  # rsc: [k] f32
    weights = np.empty((heads, k_max), np.float32)  # weights: [H, k] f32, each head's p_j * Lsc_j
    totals = np.empty(heads, np.float32)  # totals: [H] f32, each head's sum of p
    hidx = np.arange(heads)  # [H] i64: the heads as the product's rows
    for b in range(qa.shape[0]):
        k = counts[b]
        blk = 0
        for j in range(k):
            blk, r = block_of(tables, b, blk, sel[b, j])
            lc8 = carray(_u8_at(tables[b, blk, 2] + r * tables[b, blk, 3]), width)
            rc8 = carray(_u8_at(tables[b, blk, 6] + r * tables[b, blk, 7]), rope)
            for n in range(width):
                lc_f[j, n] = table[lc8[n]]
            for n in range(rope):
                rc_f[j, n] = table[rc8[n]]
            s = carray(_f32_at(tables[b, blk, 4] + r * tables[b, blk, 5]), 1)[0]
            lsc[j] = s if (s > 0 and s < _BOUND) else np.float32(0.0)
            s = carray(_f32_at(tables[b, blk, 8] + r * tables[b, blk, 9]), 1)[0]
            rsc[j] = s if (s > 0 and s < _BOUND) else np.float32(0.0)
        for h in range(heads):
            top = np.float32(-np.inf)
            wh = weights[h]
            for j in range(k):
                v = (dot_lanes(qa[b, h], lc_f[j]) * lsc[j] + dot_lanes(qr[b, h], rc_f[j]) * rsc[j]) * scale
                wh[j] = v
                if v > top:
                    top = v
            total = np.float32(0.0)
            for j in range(k):
                p = np.float32(np.exp(wh[j] - top))
                total += p
                wh[j] = p * lsc[j]
            totals[h] = total
        out = ctx[b]  # out: [H, K] f32
        tile_rows(weights[:, :k], hidx, lc_f[:k], out, hidx, width)
        for h in range(heads):
            for n in range(width):
                out[h, n] = out[h, n] / totals[h]


__all__ = ["attend_fp8_rows"]
