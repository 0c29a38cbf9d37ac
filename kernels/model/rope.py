"""Rotary position embedding for the MLA rope part, with YaRN scaling, as transformers computes it.

The rotated vector is always produced in the de-interleaved layout ``[x1*cos - x2*sin,
x2*cos + x1*sin]``: with ``rope_interleave`` the pairs are (2j, 2j+1) of the projection's
output, without it the halves (j, half+j). Either way the result is what transformers caches
and what a ``.coli_kv`` record stores as Rc.
"""
from __future__ import annotations

import math

import numpy as np

from kernels.model.config import ModelConfig, RopeConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] f32, attention_factor) for a rope width ``dim``."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)  # [dim/2] f32
    pos_freqs = np.float64(rope.theta) ** exponents.astype(np.float64)  # [dim/2] f64
    if rope.rope_type == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    low, high = _correction_range(rope, dim)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)  # [dim/2]
    extrapolation_weight = 1.0 - ramp.astype(np.float64)  # [dim/2] f64
    inv_extrapolation = 1.0 / pos_freqs
    inv_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def _correction_range(rope: RopeConfig, dim: int) -> tuple[float, float]:
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 for YaRN configs that set it."""
    scale: float = cfg.qk_head_dim**-0.5  # int ** negative int: typeshed says Any
    if cfg.rope.rope_type != "default" and cfg.rope.mscale_all_dim:
        m = yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim)
        scale = scale * m * m
    return scale


class Rotary:
    """cos/sin tables on demand and the rotation itself, for one model."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.dim = cfg.qk_rope_head_dim
        self.interleave = cfg.rope_interleave
        self.inv_freq, factor = inverse_frequencies(cfg.rope, self.dim)  # inv_freq: [dim/2] f32
        self.attention_factor = np.float32(factor)
        self._table = self.compute(np.zeros(0, np.int64))  # (cos, sin) [P, dim/2] f32 each: grown on demand

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin: [S, dim/2] f32 for absolute ``positions`` [S] (attention factor applied).

        Rows of a table kept for the positions seen so far (grown by doubling): every element is
        computed by :meth:`compute` alone, so a row read from the table is bitwise the row computed
        for that position now (a decode step asks for one position; this spares it four ufuncs)."""
        pos = np.asarray(positions)
        if pos.size == 0 or pos.min() < 0:
            return self.compute(pos)
        top = int(pos.max())
        cos, sin = self._table  # one read: a thread growing it swaps the pair whole
        if top >= cos.shape[0]:
            size = max(1024, 1 << top.bit_length())  # the next power of two above ``top``
            cos, sin = self._table = self.compute(np.arange(size))
        return cos[pos], sin[pos]

    def compute(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin: [S, dim/2] f32 for ``positions`` [S], computed (each element alone)."""
        angles = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]  # [S, dim/2] f32 product
        cos = np.cos(angles.astype(np.float64)).astype(np.float32) * self.attention_factor  # [S, dim/2] f32
        sin = np.sin(angles.astype(np.float64)).astype(np.float32) * self.attention_factor  # [S, dim/2] f32
        return cos, sin

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate x [S, ..., dim] (f32) -> [S, ..., dim] f32 in the de-interleaved layout."""
        half = self.dim // 2
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]  # [S, ..., dim/2] pairs (2j, 2j+1)
        else:
            x1, x2 = x[..., :half], x[..., half:]  # [S, ..., dim/2] halves
        extra = x.ndim - 2
        c = cos.reshape(cos.shape[0], *([1] * extra), half)  # [S, 1.., dim/2]
        s = sin.reshape(sin.shape[0], *([1] * extra), half)
        out = np.empty(x.shape, dtype=np.float32)  # [S, ..., dim]
        out[..., :half] = x1 * c - x2 * s
        out[..., half:] = x2 * c + x1 * s
        return out
