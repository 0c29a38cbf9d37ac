"""Full MLA attention from un-absorbed queries: absorbed or expanded, picked by a cost model.

Absorbed (decode, short prefill): q_abs = q_nope @ W_UK, attend over the latent rows
(``absorbed_attention``), out = ctx @ W_UV^T. Expanded (long prefill): per tile of the cache,
K_nope = Lc @ W_UK^T and V = Lc @ W_UV^T (fp8 rows dequantised with their scales first), then
ordinary attention per head. Both walk the cache in tiles at absolute positions with an online
softmax, so scratch is bounded and results do not depend on how the rows are split into blocks.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from kernels.attention.absorbed import (
    SCORE_BUDGET_BYTES,
    OnlineSoftmax,
    absorbed_attention,
    as_query,
    mask_future,
    query_positions,
)
from kernels.attention.tiles import TileGatherer, aligned_empty, cache_shape
from kernels.errors import FormatError, ModelMismatchError
from kernels.rows import LatentRows

EXPANDED_BUDGET_BYTES = 32 << 20  # K_nope^T + V^T of one tile, all heads
EXPANDED_SLOWDOWN = 1.2  # batched per-head GEMMs ran ~1.0-1.3x slower per flop than absorbed ones on 2 cores
Path = Literal["auto", "absorbed", "expanded"]


def attention_flops(n_queries: int, length: int, heads: int, kv_lora: int, rope: int, nope: int, v_head: int,
                    causal: bool = True) -> tuple[float, float]:
    """Multiply-adds of (absorbed, expanded) for S queries over T rows (a cost model, not a timer)."""
    pairs = (n_queries * (2 * length - n_queries + 1) / 2) if causal else n_queries * length  # (query, row) pairs
    absorbed = heads * (pairs * (2 * kv_lora + rope) + n_queries * kv_lora * (nope + v_head))
    expanded = heads * (length * kv_lora * (nope + v_head) + pairs * (nope + rope + v_head))
    return float(absorbed), float(expanded) * EXPANDED_SLOWDOWN


def choose_path(n_queries: int, length: int, heads: int, kv_lora: int, rope: int, nope: int, v_head: int,
                causal: bool = True) -> Literal["absorbed", "expanded"]:
    """The cheaper path by ``attention_flops`` (absorbed on ties: it never expands the cache)."""
    absorbed, expanded = attention_flops(n_queries, length, heads, kv_lora, rope, nope, v_head, causal)
    return "expanded" if expanded < absorbed else "absorbed"


def _check_weights(w_uk: np.ndarray, w_uv: np.ndarray, heads: int, nope: int,
                   kv_lora: int) -> tuple[np.ndarray, np.ndarray]:
    uk = np.ascontiguousarray(w_uk, dtype=np.float32)  # uk: [H, nope, kv_lora] f32
    uv = np.ascontiguousarray(w_uv, dtype=np.float32)  # uv: [H, v_head, kv_lora] f32
    if uk.shape != (heads, nope, kv_lora):
        raise ModelMismatchError(f"mla_attention: w_uk {uk.shape} expected {(heads, nope, kv_lora)}")
    if uv.ndim != 3 or uv.shape[0] != heads or uv.shape[2] != kv_lora:
        raise ModelMismatchError(f"mla_attention: w_uv {uv.shape} expected ({heads}, v_head, {kv_lora})")
    return uk, uv


def mla_attention(
    q_nope: np.ndarray,
    q_rope: np.ndarray,
    blocks: Sequence[LatentRows],
    w_uk: np.ndarray,
    w_uv: np.ndarray,
    softmax_scale: float,
    *,
    causal: bool = True,
    path: Path = "auto",
) -> np.ndarray:
    """q_nope [S,H,nope], q_rope [S,H,rope] over ``blocks`` -> out [S,H,v_head] f32 (before o_proj).

    ``w_uk`` [H, nope, kv_lora] and ``w_uv`` [H, v_head, kv_lora] are kv_b's per-head slices.
    ``path`` forces "absorbed" or "expanded"; "auto" asks ``choose_path``. The two agree within
    f32 rounding (they sum the same products in a different order).
    """
    shape = cache_shape(blocks)
    qn = as_query("q_nope", q_nope)  # qn: [S, H, nope] f32
    qr = as_query("q_rope", q_rope, shape.rope)  # qr: [S, H, rope] f32
    if qn.shape[:2] != qr.shape[:2]:
        raise FormatError(f"mla_attention: q_nope {qn.shape} and q_rope {qr.shape} disagree on [S, H]")
    n_q, heads, nope = qn.shape
    uk, uv = _check_weights(w_uk, w_uv, heads, nope, shape.kv_lora)
    if path == "auto":
        path = choose_path(n_q, shape.length, heads, shape.kv_lora, shape.rope, nope, uv.shape[1], causal)
    if path == "absorbed":
        q_abs = np.matmul(qn.transpose(1, 0, 2), uk).transpose(1, 0, 2)  # q_abs: [S, H, kv_lora] f32
        ctx = absorbed_attention(q_abs, qr, blocks, softmax_scale, causal=causal)  # ctx: [S, H, kv_lora] f32
        out = np.matmul(ctx.transpose(1, 0, 2), uv.transpose(0, 2, 1))  # out: [H, S, v_head] f32
        return np.ascontiguousarray(out.transpose(1, 0, 2))
    if path == "expanded":
        return expanded_attention(qn, qr, blocks, uk, uv, softmax_scale, causal=causal)
    raise FormatError(f"mla_attention: path must be auto|absorbed|expanded, found {path!r}")


def expanded_tile_rows(heads: int, nope: int, v_head: int) -> int:
    """Rows per tile so that K_nope^T and V^T of one tile fit EXPANDED_BUDGET_BYTES."""
    return max(16, EXPANDED_BUDGET_BYTES // (heads * (nope + v_head) * 4))


def expanded_attention(
    q_nope: np.ndarray,  # [S, H, nope] f32
    q_rope: np.ndarray,  # [S, H, rope] f32
    blocks: Sequence[LatentRows],
    w_uk: np.ndarray,  # [H, nope, kv_lora] f32
    w_uv: np.ndarray,  # [H, v_head, kv_lora] f32
    softmax_scale: float,
    *,
    causal: bool = True,
) -> np.ndarray:
    """Non-absorbed MLA: expand each tile of Lc through kv_b, attend per head -> [S, H, v_head] f32."""
    shape = cache_shape(blocks)
    n_q, heads, nope = q_nope.shape
    v_head = w_uv.shape[1]
    first_pos = query_positions(n_q, shape.length, causal)
    tile = min(expanded_tile_rows(heads, nope, v_head), shape.length)
    chunk = max(1, SCORE_BUDGET_BYTES // (heads * (2 * tile + v_head) * 4))
    qn_h = np.ascontiguousarray(q_nope.transpose(1, 0, 2))  # qn_h: [H, S, nope] f32
    qr_h = np.ascontiguousarray(q_rope.transpose(1, 0, 2))  # qr_h: [H, S, rope] f32
    gather = TileGatherer(blocks, shape, tile)
    k_t = aligned_empty((heads * nope * tile,), np.float32)  # k_t: [H, nope, n] f32 = (Lc W_UK^T)^T, flat
    v_t = aligned_empty((heads * v_head * tile,), np.float32)  # v_t: [H, v_head, n] f32 = (Lc W_UV^T)^T, flat
    uk2, uv2 = w_uk.reshape(heads * nope, -1), w_uv.reshape(heads * v_head, -1)  # [H*nope|H*v, kv_lora]
    state = OnlineSoftmax(heads * n_q, v_head)  # rows ordered (h, s)
    acc = state.acc.reshape(heads, n_q, v_head)  # acc: [H, S, v_head] f32 view
    for a in range(0, shape.length, tile):
        b = min(a + tile, shape.length)
        n = b - a
        s_first = max(0, a - first_pos) if causal else 0
        if s_first >= n_q:
            break
        if gather.gather(a, b):  # fp8: rows * scale (f32 rows carry scale 1.0: unchanged)
            gather.lc[:n] *= gather.lsc[:n, None]
            gather.rc[:n] *= gather.rsc[:n, None]
        lc, rc = gather.lc[:n], gather.rc[:n]  # lc: [n, kv_lora] f32, rc: [n, rope] f32
        kt, vt = k_t[: heads * nope * n].reshape(heads, nope, n), v_t[: heads * v_head * n].reshape(heads, v_head, n)
        np.matmul(uk2, lc.T, out=kt.reshape(heads * nope, n))  # kt: [H, nope, n] (one GEMM, no broadcast)
        np.matmul(uv2, lc.T, out=vt.reshape(heads * v_head, n))  # vt: [H, v_head, n]
        for s0 in range(s_first, n_q, chunk):
            s1 = min(s0 + chunk, n_q)
            sc = np.matmul(qn_h[:, s0:s1], kt)  # sc: [H, s, n] f32
            qr_c = qr_h[:, s0:s1].reshape(heads * (s1 - s0), -1)  # qr_c: [H*s, rope] f32 (copy)
            sc += np.matmul(qr_c, rc.T).reshape(heads, s1 - s0, n)  # + rope scores [H, s, n]
            sc *= np.float32(softmax_scale)
            if causal:  # mask_future works on rows (s - s0)*H.. : apply per head on [s, n] views
                for h in range(heads):
                    mask_future(sc[h], s0, s1, 1, first_pos, a, b)
            _expanded_update(state, sc, vt, acc, s0, s1, n_q)
    out = state.result().reshape(heads, n_q, v_head)  # out: [H, S, v_head] f32
    return np.ascontiguousarray(out.transpose(1, 0, 2))


def _expanded_update(state: OnlineSoftmax, sc: np.ndarray, vt: np.ndarray, acc: np.ndarray,
                     s0: int, s1: int, n_q: int) -> None:
    """Online-softmax update of rows (h, s0..s1) with scores sc [H, s, n] and values vt [H, v, n]."""
    heads = sc.shape[0]
    m = state.m.reshape(heads, n_q)[:, s0:s1]  # m: [H, s] f32 view
    l_run = state.l.reshape(heads, n_q)[:, s0:s1]  # l_run: [H, s] f32 view of the running normaliser l
    m_new = np.maximum(m, sc.max(axis=2))  # m_new: [H, s] f32
    corr = np.exp(m - m_new)  # corr: [H, s] f32
    sc -= m_new[:, :, None]
    np.exp(sc, out=sc)  # p: [H, s, n] f32
    l_run[...] = l_run * corr + sc.sum(axis=2)
    m[...] = m_new
    part = acc[:, s0:s1]  # part: [H, s, v_head] f32 view
    part *= corr[:, :, None]
    part += np.matmul(sc, vt.transpose(0, 2, 1))  # [H, s, v_head]
