"""Sparse absorbed MLA attention (DSA): each query attends ITS selected rows of the latent cache only.

Math, per query s and head h, over the k rows t in ``selection[s]`` (absolute positions, ascending):
    score_t = (Lsc_t * (q_abs . table[Lc8_t]) + Rsc_t * (q_rope . table[Rc8_t])) * softmax_scale
    p = softmax_t(score) ;  ctx = sum_t (p_t * Lsc_t) * table[Lc8_t]
(f32 rows: no scales), exactly the absorbed attention of kernels.attention.absorbed restricted to
those rows. The selected rows are gathered, ``tile_rows`` at a time, into the bounded scratch of a
``TileGatherer`` (``gather_at``): no copy of the cache, no dequantised copy of any row beyond one
tile. The scratch holds the same bytes however the rows are split into blocks, so the result is
bitwise identical for any split. Causality is the caller's selection: query s sits at position
T - S + s and may select only rows at or before it (checked).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernels.attention.absorbed import DEFAULT_TILE_ROWS, OnlineSoftmax, as_query, check_query_pair
from kernels.attention.tiles import TileGatherer, aligned_empty, cache_shape
from kernels.errors import FormatError
from kernels.rows import LatentRows


def check_selection(selection: np.ndarray, n_queries: int, length: int) -> np.ndarray:
    """Validate a selection [S, k] (ascending absolute positions, query s sees rows <= T - S + s) -> i64."""
    sel = np.asarray(selection)
    if sel.ndim != 2 or sel.shape[0] != n_queries or sel.shape[1] < 1 or (sel.size and sel.dtype.kind not in "iu"):
        raise FormatError(f"sparse attention: selection must be integers [{n_queries}, k>=1], found "
                          f"{sel.dtype} {sel.shape}")
    sel = sel.astype(np.int64, copy=False)  # sel: [S, k] i64
    last = length - n_queries + np.arange(n_queries)  # last: [S] the newest row query s may see
    if length < n_queries or sel[:, 0].min() < 0 or bool(np.any(sel[:, -1] > last)):
        raise FormatError(f"sparse attention: selected rows must lie in [0, T - S + s] (T={length}, S={n_queries})")
    if sel.shape[1] > 1 and bool(np.any(sel[:, 1:] <= sel[:, :-1])):
        raise FormatError("sparse attention: each query's selected positions must ascend strictly")
    return sel


def sparse_absorbed_attention(
    q_abs: np.ndarray,
    q_rope: np.ndarray,
    blocks: Sequence[LatentRows],
    selection: np.ndarray,
    softmax_scale: float,
    *,
    tile_rows: int = DEFAULT_TILE_ROWS,
) -> np.ndarray:
    """q_abs [S,H,kv_lora], q_rope [S,H,rope] over rows ``selection`` [S,k] of ``blocks`` -> ctx [S,H,kv_lora] f32."""
    shape = cache_shape(blocks)
    qa = as_query("q_abs", q_abs, shape.kv_lora)  # qa: [S, H, kv_lora] f32
    qr = as_query("q_rope", q_rope, shape.rope)  # qr: [S, H, rope] f32
    n_q, heads = check_query_pair("sparse attention", qa, qr, tile_rows)
    sel = check_selection(selection, n_q, shape.length)  # sel: [S, k] i64
    k = sel.shape[1]
    tile = min(tile_rows, k)
    gather = TileGatherer(blocks, shape, tile)
    state = OnlineSoftmax(n_q * heads, shape.kv_lora)
    qa2, qr2 = qa.reshape(n_q * heads, -1), qr.reshape(n_q * heads, -1)  # [S*H, kv_lora], [S*H, rope]
    sbuf = aligned_empty((heads, tile), np.float32)  # sbuf: [H, tile] f32 scores
    rbuf = aligned_empty((heads, tile), np.float32)  # rbuf: [H, tile] f32 rope scores
    cbuf = aligned_empty((heads, shape.kv_lora), np.float32)  # cbuf: [H, kv_lora] f32 ctx partial
    scale = np.float32(softmax_scale)
    for s in range(n_q):
        r0, r1 = s * heads, (s + 1) * heads
        for a in range(0, k, tile):
            rows = sel[s, a : a + tile]  # rows: [n] i64 absolute positions
            n = rows.shape[0]
            fp8 = gather.gather_at(rows)
            lc, rc, lsc, rsc = gather.lc[:n], gather.rc[:n], gather.lsc[:n], gather.rsc[:n]
            sc, rs = sbuf[:, :n], rbuf[:, :n]  # [H, n] f32 each
            np.matmul(qa2[r0:r1], lc.T, out=sc)
            np.matmul(qr2[r0:r1], rc.T, out=rs)
            if fp8:  # scales hoisted out of the dots
                sc *= lsc
                rs *= rsc
            sc += rs
            sc *= scale
            p = state.weights(r0, r1, sc)  # p: [H, n] f32
            if fp8:
                p *= lsc
            np.matmul(p, lc, out=cbuf)
            state.acc[r0:r1] += cbuf
    return state.result().reshape(n_q, heads, shape.kv_lora)


def sparse_scratch_bytes(heads: int, kv_lora: int, rope: int, k: int, tile_rows: int = DEFAULT_TILE_ROWS) -> int:
    """Bytes of scratch ``sparse_absorbed_attention`` allocates beyond its inputs and the output state."""
    tile = min(tile_rows, k)
    return tile * (kv_lora + rope + 2) * 4 + heads * (2 * tile + kv_lora) * 4
