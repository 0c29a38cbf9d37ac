"""A DeepSeek-V3 / GLM-5 checkpoint's layers as the reference decoder holds them: each layer's MLA
weights (kv_b split per head into W_UK and W_UV), its norms and its dense MLP or MoE, read from a
checkpoint by their Hugging Face names (the checkpoint's layout or transformers' fused experts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kernels.model.config import ModelConfig
from kernels.model.moe import DenseMLP, MoE


class Weights(Protocol):
    source: str

    def __contains__(self, name: object) -> bool: ...

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray: ...


@dataclass(frozen=True)
class MLAttention:
    """One layer's MLA weights, kv_b split per head into W_UK and W_UV."""

    q_proj: np.ndarray | None  # [H*qk_head, hidden] (no q_lora)
    q_a: np.ndarray | None  # [q_lora, hidden]
    q_a_bias: np.ndarray | None  # [q_lora]
    q_a_norm: np.ndarray | None  # [q_lora]
    q_b: np.ndarray | None  # [H*qk_head, q_lora]
    kv_a: np.ndarray  # [kv_lora + rope, hidden]
    kv_a_bias: np.ndarray | None  # [kv_lora + rope]
    kv_a_norm: np.ndarray  # [kv_lora]
    w_uk: np.ndarray  # [H, qk_nope, kv_lora]
    w_uv: np.ndarray  # [H, v_head, kv_lora]
    o_proj: np.ndarray  # [hidden, H*v_head]
    o_bias: np.ndarray | None  # [hidden]


@dataclass(frozen=True)
class DecoderLayer:
    input_norm: np.ndarray  # [hidden]
    post_norm: np.ndarray  # [hidden]
    attn: MLAttention
    mlp: DenseMLP | MoE


def load_layer(cfg: ModelConfig, w: Weights, i: int) -> DecoderLayer:
    """Layer ``i`` of the checkpoint ``w`` (f32 arrays, shapes checked against ``cfg``)."""
    p = f"model.layers.{i}."
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads

    def bias(name: str, n: int) -> np.ndarray | None:
        return w.get(p + name, (n,)) if cfg.attention_bias else None

    q_out = heads * cfg.qk_head_dim
    kv_a_out = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    q_lora = cfg.q_lora_rank
    kv_b = w.get(p + "self_attn.kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
    kv_b = kv_b.reshape(heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)  # [H, nope+v, kv_lora]
    attn = MLAttention(
        q_proj=None if q_lora else w.get(p + "self_attn.q_proj.weight", (q_out, hidden)),
        q_a=w.get(p + "self_attn.q_a_proj.weight", (q_lora, hidden)) if q_lora else None,
        q_a_bias=bias("self_attn.q_a_proj.bias", q_lora) if q_lora else None,
        q_a_norm=w.get(p + "self_attn.q_a_layernorm.weight", (q_lora,)) if q_lora else None,
        q_b=w.get(p + "self_attn.q_b_proj.weight", (q_out, q_lora)) if q_lora else None,
        kv_a=w.get(p + "self_attn.kv_a_proj_with_mqa.weight", (kv_a_out, hidden)),
        kv_a_bias=bias("self_attn.kv_a_proj_with_mqa.bias", kv_a_out),
        kv_a_norm=w.get(p + "self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
        w_uk=np.ascontiguousarray(kv_b[:, : cfg.qk_nope_head_dim, :]),  # [H, nope, kv_lora]
        w_uv=np.ascontiguousarray(kv_b[:, cfg.qk_nope_head_dim :, :]),  # [H, v_head, kv_lora]
        o_proj=w.get(p + "self_attn.o_proj.weight", (hidden, heads * cfg.v_head_dim)),
        o_bias=bias("self_attn.o_proj.bias", hidden),
    )
    mlp = _load_moe(cfg, w, p) if cfg.is_moe_layer(i) else _load_mlp(w, p + "mlp.", hidden, cfg.intermediate_size)
    return DecoderLayer(
        input_norm=w.get(p + "input_layernorm.weight", (hidden,)),
        post_norm=w.get(p + "post_attention_layernorm.weight", (hidden,)),
        attn=attn,
        mlp=mlp,
    )


def _load_mlp(w: Weights, prefix: str, hidden: int, inter: int) -> DenseMLP:
    return DenseMLP(
        gate=w.get(prefix + "gate_proj.weight", (inter, hidden)),
        up=w.get(prefix + "up_proj.weight", (inter, hidden)),
        down=w.get(prefix + "down_proj.weight", (hidden, inter)),
    )


def _load_moe(cfg: ModelConfig, w: Weights, p: str) -> MoE:
    hidden, inter, n_exp = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    fused = p + "mlp.experts.gate_up_proj"
    if fused in w:  # transformers' in-memory layout: [E, 2I, hidden] + [E, hidden, I]
        gate_up = w.get(fused, (n_exp, 2 * inter, hidden))
        down = w.get(p + "mlp.experts.down_proj", (n_exp, hidden, inter))
        experts = [DenseMLP(gate_up[e, :inter], gate_up[e, inter:], down[e]) for e in range(n_exp)]
    else:  # checkpoint layout: one module per expert
        experts = [_load_mlp(w, f"{p}mlp.experts.{e}.", hidden, inter) for e in range(n_exp)]
    shared = None
    if cfg.n_shared_experts:
        shared = _load_mlp(w, p + "mlp.shared_experts.", hidden, inter * cfg.n_shared_experts)
    return MoE(
        cfg,
        gate_w=w.get(p + "mlp.gate.weight", (n_exp, hidden)),
        bias=w.get(p + "mlp.gate.e_score_correction_bias", (n_exp,)),
        experts=experts,
        shared=shared,
    )


__all__ = ["DecoderLayer", "MLAttention", "Weights", "load_layer"]
