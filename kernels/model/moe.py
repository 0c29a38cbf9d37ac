"""Feed-forward blocks: the dense SwiGLU MLP and the DeepSeek-V3 mixture of experts.

V3 router: scores = sigmoid(x @ W_gate^T); the correction bias is added for CHOOSING experts
only; experts are chosen inside the ``topk_group`` best groups (group score = sum of the top-2
biased scores of the group); the chosen experts' unbiased scores are their weights, optionally
normalised to sum 1 (``norm_topk_prob``), then multiplied by ``routed_scaling_factor``. Shared
experts run on every token and are added.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.model.config import ModelConfig
from kernels.model.moe_step import StackedExperts
from kernels.model.rowwise import rowwise_linear


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), f32."""
    y: np.ndarray = x / (np.float32(1.0) + np.exp(-x))  # y: [*x.shape] f32
    return y


@dataclass(frozen=True)
class DenseMLP:
    """down(silu(gate(x)) * up(x))."""

    gate: np.ndarray  # [I, hidden] f32
    up: np.ndarray  # [I, hidden] f32
    down: np.ndarray  # [hidden, I] f32

    def __call__(self, x: np.ndarray, rowwise: bool = False) -> np.ndarray:
        """x [N, hidden] f32 -> [N, hidden] f32 (``rowwise``: each row alone, batch-invariant)."""
        if rowwise:
            inner = silu(rowwise_linear(x, self.gate)) * rowwise_linear(x, self.up)  # [N, I] f32
            return rowwise_linear(inner, self.down)  # [N, hidden] f32
        y: np.ndarray = (silu(x @ self.gate.T) * (x @ self.up.T)) @ self.down.T  # y: [N, hidden] f32
        return y


def route(
    x: np.ndarray, gate_w: np.ndarray, bias: np.ndarray, cfg: ModelConfig, rowwise: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(weights [N, k] f32, experts [N, k] i64) for tokens x [N, hidden] f32."""
    n_tok = x.shape[0]
    n_exp, n_group, k = cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
    per_group = n_exp // n_group
    logits = rowwise_linear(x, gate_w) if rowwise else x @ gate_w.T  # [N, E] f32
    scores = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))  # [N, E] f32 sigmoid
    choice = scores + bias[None, :]  # [N, E] f32, for choosing only
    grouped = choice.reshape(n_tok, n_group, per_group)  # [N, G, E/G]
    top2 = -np.sort(-grouped, axis=-1)[..., :2]  # [N, G, 2]
    group_scores = top2[..., 0] + top2[..., 1]  # [N, G]
    best_groups = _top_indices(group_scores, cfg.topk_group)  # [N, topk_group]
    allowed = np.zeros((n_tok, n_group), dtype=bool)  # [N, G]
    np.put_along_axis(allowed, best_groups, True, axis=1)
    masked = np.where(np.repeat(allowed, per_group, axis=1), choice, -np.inf)  # [N, E]
    experts = _top_indices(masked, k)  # [N, k] i64
    weights = np.take_along_axis(scores, experts, axis=1)  # [N, k] f32
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    weights = weights * np.float32(cfg.routed_scaling_factor)
    return weights.astype(np.float32), experts


def _top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row [N, k]; ties go to the lower index (deterministic)."""
    order = np.argsort(-values, axis=-1, kind="stable")  # [N, n]
    return order[:, :k]


class MoE:
    """Routed experts + shared experts of one layer."""

    def __init__(
        self,
        cfg: ModelConfig,
        gate_w: np.ndarray,  # [E, hidden] f32
        bias: np.ndarray,  # [E] f32
        experts: list[DenseMLP],
        shared: DenseMLP | None,
    ) -> None:
        self.cfg = cfg
        self.gate_w = gate_w
        self.bias = bias
        self.experts = experts
        self.shared = shared
        self._stacked: StackedExperts | None = None  # built on the first batch-invariant call that fits it
        self._stackable = StackedExperts.fits(experts)  # the experts' shapes decide it, once

    def __call__(self, x: np.ndarray, rowwise: bool = False) -> np.ndarray:
        """x [N, hidden] f32 -> [N, hidden] f32; experts accumulate in ascending expert order
        (``rowwise``: each token alone, batch-invariant)."""
        weights, chosen = route(x, self.gate_w, self.bias, self.cfg, rowwise)  # [N, k], [N, k]
        if rowwise and self._stackable:  # the whole batch's experts in two compiled calls
            if self._stacked is None:
                self._stacked = StackedExperts(self.experts)
            out = self._stacked(x, weights, chosen, silu)  # [N, hidden] f32, bitwise the loop's
            return out + self.shared(x, rowwise) if self.shared is not None else out
        out = np.zeros_like(x)  # [N, hidden] f32
        for expert in np.unique(chosen):
            tok, slot = np.nonzero(chosen == expert)  # tokens routed to this expert
            y = self.experts[int(expert)](x[tok], rowwise)  # [n, hidden]
            out[tok] += y * weights[tok, slot][:, None]  # a token picks an expert at most once
        if self.shared is not None:
            out = out + self.shared(x, rowwise)
        return out
