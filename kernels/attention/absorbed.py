"""Absorbed MLA attention over the latent cache (numpy), f32 rows or fp8 rows + per-row scales.

Math (per head h, per query s at absolute position pos_s = T - S + s):
    score_t = (Lsc_t * (q_abs . table[Lc8_t]) + Rsc_t * (q_rope . table[Rc8_t])) * softmax_scale
    p = softmax_t(score), t <= pos_s (causal) ;  ctx = sum_t (p_t * Lsc_t) * table[Lc8_t]
f32 rows are the same with no scales. The caller applies W_UV and o_proj (or use ``mla_attention``).

The cache is walked in tiles at ABSOLUTE positions (``kernels.attention.tiles``) with an online
softmax, so the scratch stays bounded whatever T is (<= ``SCRATCH_LIMIT_BYTES``), no dequantised
copy of the cache is ever made, and the result is bitwise identical however the rows are split
into blocks and whatever their strides (each tile is first gathered into aligned scratch).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels.attention.tiles import CacheShape, TileGatherer, aligned_empty, cache_shape
from kernels.attention.tq import rotate_queries, unrotate_context
from kernels.errors import FormatError, ModelMismatchError
from kernels.rows import LatentRows

DEFAULT_TILE_ROWS = 1024  # a decoded f32 tile is 2 MiB: in L2/L3; measured best of 256..2048 on 2 cores
SCRATCH_LIMIT_BYTES = 64 << 20  # contract: extra memory beyond inputs and output
SCORE_BUDGET_BYTES = 16 << 20  # per query chunk: scores + rope scores + ctx partial


def as_query(name: str, q: np.ndarray, width: int | None = None) -> np.ndarray:
    """Validate a query array [S, H, width] and return it as contiguous f32."""
    arr = np.asarray(q)
    if arr.dtype.kind != "f" or arr.ndim != 3 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise FormatError(f"attention: {name} must be a float array [S, H, width], found {arr.dtype} {arr.shape}")
    if width is not None and arr.shape[2] != width:
        raise ModelMismatchError(f"attention: {name} width {arr.shape[2]} != cache width {width}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def check_query_pair(what: str, qa: Any, qr: Any, tile_rows: int | None = None) -> tuple[int, int]:
    """q_abs [S, H, *] and q_rope [S, H, *] (numpy or device arrays) must agree on [S, H]; a tile
    size, when given, must be >= 1. Returns (S, H). ``what`` names the caller in the error."""
    if qa.shape[:2] != qr.shape[:2]:
        raise FormatError(f"{what}: q_abs {qa.shape} and q_rope {qr.shape} disagree on [S, H]")
    if tile_rows is not None and tile_rows < 1:
        raise FormatError(f"{what}: tile_rows must be >= 1, found {tile_rows}")
    return int(qa.shape[0]), int(qa.shape[1])


def query_positions(n_queries: int, length: int, causal: bool) -> int:
    """Absolute position of query 0 (T - S when causal); validates T >= S."""
    if causal and n_queries > length:
        raise FormatError(f"attention: {n_queries} causal queries need at least as many cache rows, found {length}")
    return length - n_queries if causal else 0


class OnlineSoftmax:
    """Running max ``m``, normaliser ``l`` and weighted sum ``acc`` for R = S*H query rows."""

    def __init__(self, rows: int, width: int) -> None:
        self.m = np.full(rows, -np.inf, np.float32)  # m: [R] f32
        self.l = np.zeros(rows, np.float32)  # l: [R] f32
        self.acc = np.zeros((rows, width), np.float32)  # acc: [R, width] f32 (the output's size)

    def weights(self, r0: int, r1: int, scores: np.ndarray) -> np.ndarray:
        """Turn ``scores`` [r, n] into p = exp(score - m_new) in place; rescale l and acc rows."""
        m_old = self.m[r0:r1]  # m_old: [r] f32
        m_new = np.maximum(m_old, scores.max(axis=1))  # m_new: [r] f32
        corr = np.exp(m_old - m_new)  # corr: [r] f32 (0 on the first tile a row sees)
        scores -= m_new[:, None]
        np.exp(scores, out=scores)  # p: [r, n] f32
        self.l[r0:r1] = self.l[r0:r1] * corr + scores.sum(axis=1)
        self.m[r0:r1] = m_new
        self.acc[r0:r1] *= corr[:, None]
        return scores

    def result(self) -> np.ndarray:
        """acc / l, in place (the state is spent): ctx [R, width] f32."""
        self.acc /= self.l[:, None]
        return self.acc


def mask_future(scores: np.ndarray, s0: int, s1: int, heads: int, first_pos: int, a: int, b: int) -> None:
    """-inf where query s (rows (s - s0)*H ..) would see a row past its position pos_s."""
    for s in range(max(s0, a - first_pos), min(s1, b - 1 - first_pos)):
        keep = first_pos + s - a + 1  # rows a .. pos_s of this tile are visible
        r = (s - s0) * heads
        scores[r : r + heads, keep:] = -np.inf


def absorbed_attention(
    q_abs: np.ndarray,
    q_rope: np.ndarray,
    blocks: Sequence[LatentRows],
    softmax_scale: float,
    *,
    causal: bool = True,
    tile_rows: int = DEFAULT_TILE_ROWS,
) -> np.ndarray:
    """Absorbed MLA attention: q_abs [S,H,kv_lora], q_rope [S,H,rope] over ``blocks`` -> ctx [S,H,kv_lora] f32.

    The cache is the concatenation of ``blocks`` (F32Rows and/or Fp8Rows, or only TqRows; T rows in
    all); query s sits at position T-S+s and (causal) attends rows 0..T-S+s. Deterministic and
    bitwise identical for any split of the same rows into blocks, strided or contiguous.
    v3 rows are attended in the rotated domain (kernels.attention.tq): q rotated once, ctx unrotated once.
    """
    shape = cache_shape(blocks)
    qa = as_query("q_abs", q_abs, shape.kv_lora)  # qa: [S, H, kv_lora] f32
    qr = as_query("q_rope", q_rope, shape.rope)  # qr: [S, H, rope] f32
    n_q, heads = check_query_pair("attention", qa, qr, tile_rows)
    first_pos = query_positions(n_q, shape.length, causal)
    if shape.tq is not None:
        qa, qr = rotate_queries(qa, shape.tq), rotate_queries(qr, shape.tq)  # [S, H, kv_lora], [S, H, rope] rotated
    tile = min(tile_rows, shape.length)
    chunk = query_chunk(heads, tile, shape.kv_lora)
    state = OnlineSoftmax(n_q * heads, shape.kv_lora)
    _walk_tiles(qa.reshape(n_q * heads, -1), qr.reshape(n_q * heads, -1), blocks, shape, float(softmax_scale),
                causal, first_pos, heads, tile, chunk, state)
    ctx = state.result()  # ctx: [S*H, kv_lora] f32
    if shape.tq is not None:
        ctx = unrotate_context(ctx, shape.tq)
    return ctx.reshape(n_q, heads, shape.kv_lora)


def query_chunk(heads: int, tile: int, width: int) -> int:
    """Queries per chunk so that scores + rope scores + a ctx partial fit SCORE_BUDGET_BYTES."""
    per_query = heads * (2 * tile + width) * 4
    return max(1, SCORE_BUDGET_BYTES // per_query)


def _walk_tiles(
    qa2: np.ndarray,  # [S*H, kv_lora] f32
    qr2: np.ndarray,  # [S*H, rope] f32
    blocks: Sequence[LatentRows],
    shape: CacheShape,
    scale: float,
    causal: bool,
    first_pos: int,
    heads: int,
    tile: int,
    chunk: int,
    state: OnlineSoftmax,
) -> None:
    n_q = qa2.shape[0] // heads
    rows_max = min(chunk, n_q) * heads
    gather = TileGatherer(blocks, shape, tile, tq_rotated=shape.tq is not None)
    sbuf = aligned_empty((rows_max, tile), np.float32)  # sbuf: [rows, tile] f32 scores
    rbuf = aligned_empty((rows_max, tile), np.float32)  # rbuf: [rows, tile] f32 rope scores
    cbuf = aligned_empty((rows_max, shape.kv_lora), np.float32)  # cbuf: [rows, kv_lora] f32 ctx partial
    for a in range(0, shape.length, tile):
        b = min(a + tile, shape.length)
        n = b - a
        s_first = max(0, a - first_pos) if causal else 0  # queries before this tile see none of it
        if s_first >= n_q:
            break
        fp8 = gather.gather(a, b)
        lc, rc, lsc, rsc = gather.lc[:n], gather.rc[:n], gather.lsc[:n], gather.rsc[:n]
        for s0 in range(s_first, n_q, chunk):
            s1 = min(s0 + chunk, n_q)
            r0, r1 = s0 * heads, s1 * heads
            sc = sbuf[: r1 - r0, :n]  # sc: [r, n] f32
            rs = rbuf[: r1 - r0, :n]  # rs: [r, n] f32
            np.matmul(qa2[r0:r1], lc.T, out=sc)
            np.matmul(qr2[r0:r1], rc.T, out=rs)
            if fp8:  # scales hoisted out of the dots
                sc *= lsc
                rs *= rsc
            sc += rs
            sc *= np.float32(scale)
            if causal:
                mask_future(sc, s0, s1, heads, first_pos, a, b)
            p = state.weights(r0, r1, sc)  # p: [r, n] f32
            if fp8:
                p *= lsc
            ctx = cbuf[: r1 - r0]  # ctx: [r, kv_lora] f32
            np.matmul(p, lc, out=ctx)
            state.acc[r0:r1] += ctx


def absorbed_scratch_bytes(n_queries: int, heads: int, kv_lora: int, rope: int, length: int,
                           tile_rows: int = DEFAULT_TILE_ROWS) -> int:
    """Bytes of scratch ``absorbed_attention`` allocates beyond its inputs and the output state."""
    tile = min(tile_rows, length)
    rows = min(query_chunk(heads, tile, kv_lora), n_queries) * heads
    gather = tile * (kv_lora + rope + 2) * 4
    return gather + rows * (2 * tile + kv_lora) * 4
