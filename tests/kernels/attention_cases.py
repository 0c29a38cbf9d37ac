"""Shared data and float64 references for the attention tests (CPU and CUDA).

Tolerances (max |a - b| / max |ref|, over the whole output):
- CPU f32 vs the float64 reference on the same rows: F32_RTOL.
- CPU fp8 vs the float64 reference on the dequantised rows (table[code] * scale): F32_RTOL
  (the kernel only reorders exact products: the decode is exact, scales are hoisted).
- CPU fp8 vs CPU f32 on the rows before quantisation: FP8_VS_F32_RTOL (the e4m3 rounding of
  the cache, |deq - x| <= |x|/16 + scale*2^-10 per element; measured ~1.6e-2 on these data).
- CUDA "simt"/"mma" vs CPU on the same rows: CUDA_RTOL (f32 arithmetic or f16 hi/lo splits, other
  summation order); "mma_fast" vs CPU: CUDA_FAST_RTOL (single f16 operands).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from kernels.fp8 import dequantize_rows, quantize_rows
from kernels.rows import F32Rows, Fp8Rows

F32_RTOL = 2e-5
FP8_VS_F32_RTOL = 5e-2
CUDA_RTOL = 5e-5


def latent_rows(rng: np.random.Generator, length: int, kv_lora: int, rope: int,
                outliers: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Random Lc/Rc rows with per-row magnitude spread and (optionally) 30x outliers."""
    lc = rng.standard_normal((length, kv_lora)).astype(np.float32)  # lc: [T, kv_lora] f32
    rc = rng.standard_normal((length, rope)).astype(np.float32)  # rc: [T, rope] f32
    lc *= rng.uniform(0.2, 2.0, (length, 1)).astype(np.float32)
    if outliers:
        hit = rng.random(lc.shape) < 0.002
        lc[hit] *= 30.0
        rc[rng.random(rc.shape) < 0.002] *= 30.0
    return lc, rc


def queries(rng: np.random.Generator, n_q: int, heads: int, width: int, gain: float = 1.0) -> np.ndarray:
    return (rng.standard_normal((n_q, heads, width)) * gain).astype(np.float32)  # [S, H, width] f32


@dataclass
class Fp8Cache:
    """fp8 codes + scales of some rows, and their dequantised f32 values (the reference rows)."""

    rows: Fp8Rows
    lc_deq: np.ndarray  # [T, kv_lora] f32
    rc_deq: np.ndarray  # [T, rope] f32


def quantize(lc: np.ndarray, rc: np.ndarray) -> Fp8Cache:
    lc_codes, lc_scale = quantize_rows(lc)
    rc_codes, rc_scale = quantize_rows(rc)
    rows = Fp8Rows(lc_codes, lc_scale, rc_codes, rc_scale)
    return Fp8Cache(rows, dequantize_rows(lc_codes, lc_scale), dequantize_rows(rc_codes, rc_scale))


def split_rows(rows: F32Rows | Fp8Rows, cuts: list[int]) -> list[F32Rows | Fp8Rows]:
    """The same rows as consecutive blocks cut at ``cuts`` (views, no copies)."""
    edges = [0, *cuts, rows.length]
    if isinstance(rows, F32Rows):
        return [F32Rows(rows.lc[a:b], rows.rc[a:b]) for a, b in pairwise(edges)]
    return [
        Fp8Rows(rows.lc_codes[a:b], rows.lc_scale[a:b], rows.rc_codes[a:b], rows.rc_scale[a:b])
        for a, b in pairwise(edges)
    ]


def reference_absorbed(q_abs: np.ndarray, q_rope: np.ndarray, lc: np.ndarray, rc: np.ndarray, scale: float,
                       causal: bool = True) -> np.ndarray:
    """Naive float64 absorbed attention -> ctx [S, H, kv_lora] f64."""
    n_q, length = q_abs.shape[0], lc.shape[0]
    sc = np.einsum("shk,tk->sht", q_abs.astype(np.float64), lc.astype(np.float64))
    sc += np.einsum("shk,tk->sht", q_rope.astype(np.float64), rc.astype(np.float64))
    sc *= scale
    if causal:
        pos = length - n_q + np.arange(n_q)  # pos: [S]
        future = np.arange(length)[None, :] > pos[:, None]  # future: [S, T]
        sc = np.where(future[:, None, :], -np.inf, sc)
    p = np.exp(sc - sc.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("sht,tk->shk", p, lc.astype(np.float64))


def reference_mla(q_nope: np.ndarray, q_rope: np.ndarray, lc: np.ndarray, rc: np.ndarray, w_uk: np.ndarray,
                  w_uv: np.ndarray, scale: float, causal: bool = True) -> np.ndarray:
    """Naive float64 non-absorbed MLA (expand K_nope and V per head) -> out [S, H, v_head] f64."""
    lc64 = lc.astype(np.float64)
    k_nope = np.einsum("tk,hnk->thn", lc64, w_uk.astype(np.float64))  # [T, H, nope]
    v = np.einsum("tk,hvk->thv", lc64, w_uv.astype(np.float64))  # [T, H, v_head]
    n_q, length = q_nope.shape[0], lc.shape[0]
    sc = np.einsum("shn,thn->sht", q_nope.astype(np.float64), k_nope)
    sc += np.einsum("shr,tr->sht", q_rope.astype(np.float64), rc.astype(np.float64))
    sc *= scale
    if causal:
        pos = length - n_q + np.arange(n_q)
        sc = np.where((np.arange(length)[None, :] > pos[:, None])[:, None, :], -np.inf, sc)
    p = np.exp(sc - sc.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("sht,thv->shv", p, v)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def record_array(lc_codes: np.ndarray, lc_scale: np.ndarray, rc_codes: np.ndarray, rc_scale: np.ndarray,
                 n_layers: int, layer: int) -> np.ndarray:
    """A v2-style structured record array (token, L x (lc, lc_scale, rc, rc_scale)) holding the
    given rows in layer ``layer`` (other layers zero): its field views are strided like an mmap."""
    length, kv_lora = lc_codes.shape
    rope = rc_codes.shape[1]
    layer_dt = np.dtype([("lc", "u1", (kv_lora,)), ("lc_scale", "<f4"), ("rc", "u1", (rope,)), ("rc_scale", "<f4")])
    rec_dt = np.dtype([("token", "<i4"), ("layers", layer_dt, (n_layers,))])
    recs = np.zeros(length, rec_dt)  # recs: [T] records
    recs["token"] = np.arange(length)
    lay = recs["layers"][:, layer]
    lay["lc"], lay["lc_scale"], lay["rc"], lay["rc_scale"] = lc_codes, lc_scale, rc_codes, rc_scale
    return recs


def record_view(recs: np.ndarray, layer: int) -> Fp8Rows:
    lay = recs["layers"][:, layer]
    return Fp8Rows(lay["lc"], lay["lc_scale"], lay["rc"], lay["rc_scale"])
CUDA_FAST_RTOL = 3e-3  # "mma_fast": q and P rounded once to f16 (2^-11 relative per operand)
