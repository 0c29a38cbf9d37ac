"""The DSA indexer of one full GLM layer: its key per position (the file's Ic row) and its queries.

Key (written for every position, prefill and decode): ``k = LayerNorm(wk @ x)`` with weight and
bias (eps 1e-6, population variance), then RoPE on the first qk_rope dims (interleaved pairs in,
half-split out, as the latent's k_rot); the remaining dims pass through. f32.
Queries: ``qi = wq_b @ q_resid`` viewed as nh heads of hd, each roped the same way, and the head
weights ``w = (weights_proj @ x) * nh ** -0.5``. Scoring and top-k: kernels.attention.selection.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.model.rope import Rotary
from kernels.model.rowwise import rowwise_linear

LAYER_NORM_EPS = 1e-6


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = LAYER_NORM_EPS) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (population variance), f32."""
    mean = np.mean(x, axis=-1, keepdims=True, dtype=np.float32)  # [..., 1] f32
    d = x - mean  # d: [..., D] f32
    var = np.mean(np.square(d), axis=-1, keepdims=True, dtype=np.float32)  # [..., 1] f32
    y: np.ndarray = d * (np.float32(1.0) / np.sqrt(var + np.float32(eps))) * weight + bias  # y: [..., D] f32
    return y


@dataclass(frozen=True)
class Indexer:
    """One full layer's indexer weights (``model.layers.{i}.self_attn.indexer.*``)."""

    wq_b: np.ndarray  # [nh*hd, q_lora] f32
    wk: np.ndarray  # [hd, hidden] f32
    k_norm_weight: np.ndarray  # [hd] f32
    k_norm_bias: np.ndarray  # [hd] f32
    weights_proj: np.ndarray  # [nh, hidden] f32
    n_heads: int
    head_dim: int

    def keys(self, x: np.ndarray, rotary: Rotary, cos: np.ndarray, sin: np.ndarray,
             rowwise: bool = False) -> np.ndarray:
        """Indexer keys of the normalised layer input x [S, hidden] -> [S, hd] f32."""
        kx = rowwise_linear(x, self.wk) if rowwise else x @ self.wk.T  # [S, hd] f32
        k = layer_norm(kx, self.k_norm_weight, self.k_norm_bias)  # k: [S, hd] f32
        return _rope_prefix(k, rotary, cos, sin)

    def queries(self, x: np.ndarray, q_resid: np.ndarray, rotary: Rotary, cos: np.ndarray,
                sin: np.ndarray, rowwise: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(qi [S, nh, hd] f32 roped, w [S, nh] f32 scaled by nh ** -0.5)."""
        qx = rowwise_linear(q_resid, self.wq_b) if rowwise else q_resid @ self.wq_b.T  # [S, nh*hd]
        qi = qx.reshape(q_resid.shape[0], self.n_heads, self.head_dim)  # [S, nh, hd]
        wx = rowwise_linear(x, self.weights_proj) if rowwise else x @ self.weights_proj.T  # [S, nh]
        w = wx * np.float32(self.n_heads**-0.5)  # w: [S, nh] f32
        return _rope_prefix(qi, rotary, cos, sin), w.astype(np.float32)


def _rope_prefix(v: np.ndarray, rotary: Rotary, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE on the first qk_rope dims of v [S, ..., hd]; the rest pass through."""
    out = np.array(v, dtype=np.float32)  # out: [S, ..., hd] f32 (a copy)
    out[..., : rotary.dim] = rotary.apply(v[..., : rotary.dim], cos, sin)
    return out
