"""The embedded ``tiny`` model: a real HF-shaped ``deepseek_v3`` config with seeded weights.

Byte-level vocabulary: ids 0..255 are the bytes, then ``<bos>`` 256, ``<eos>`` 257, ``<pad>``
258, ``<unk>`` 259. q_lora MLA, one dense layer then MoE layers (V3 router with groups), YaRN
RoPE over 4096 positions, interleaved rope weights. Weights come from numpy's legacy
``RandomState`` (its streams are frozen across numpy versions) and are scaled so that
next-token margins are wide: demos and tests need no download and get stable tokens.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kernels.errors import UnsupportedModelError
from kernels.model.config import ModelConfig, parse_config
from kernels.model.weights import DictWeights

TINY_NAME = "tiny"
TINY_SEED = 1234
BOS_ID, EOS_ID, PAD_ID, UNK_ID = 256, 257, 258, 259


def tiny_config_dict() -> dict[str, Any]:
    """The tiny model's config.json content (a fresh dict)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 260,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 64,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
        "rope_interleave": True,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "num_nextn_predict_layers": 0,
        "torch_dtype": "float32",
    }


def tiny_weights(cfg: ModelConfig, seed: int = TINY_SEED) -> dict[str, np.ndarray]:
    """Seeded f32 weights for ``cfg`` under their Hugging Face names."""
    rng = np.random.RandomState(seed)
    hidden = cfg.hidden_size

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def linear(out: int, inp: int, gain: float = 1.0) -> np.ndarray:
        return normal((out, inp), gain / np.sqrt(inp))

    def norm(n: int) -> np.ndarray:
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": normal((cfg.vocab_size, hidden), 1.0),
        "model.norm.weight": norm(hidden),
        "lm_head.weight": linear(cfg.vocab_size, hidden, 4.0),
    }
    heads, qk, v = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    q_lora = cfg.q_lora_rank
    if q_lora is None:
        raise UnsupportedModelError("tiny_weights: the config has no q_lora_rank (tiny layers use q_a/q_b projections)")
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_a_proj.weight"] = linear(q_lora, hidden)
        w[p + "self_attn.q_a_layernorm.weight"] = norm(q_lora)
        w[p + "self_attn.q_b_proj.weight"] = linear(heads * qk, q_lora, 2.0)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = linear(cfg.kv_lora_rank + cfg.qk_rope_head_dim, hidden)
        w[p + "self_attn.kv_a_layernorm.weight"] = norm(cfg.kv_lora_rank)
        w[p + "self_attn.kv_b_proj.weight"] = linear(heads * (cfg.qk_nope_head_dim + v), cfg.kv_lora_rank, 2.0)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, heads * v, 0.3)
        if cfg.is_moe_layer(i):
            inter = cfg.moe_intermediate_size
            w[p + "mlp.gate.weight"] = linear(cfg.n_routed_experts, hidden, 2.0)
            w[p + "mlp.gate.e_score_correction_bias"] = normal((cfg.n_routed_experts,), 0.05)
            for e in range(cfg.n_routed_experts):
                _mlp(w, f"{p}mlp.experts.{e}.", hidden, inter, linear)
            _mlp(w, p + "mlp.shared_experts.", hidden, inter * cfg.n_shared_experts, linear)
        else:
            _mlp(w, p + "mlp.", hidden, cfg.intermediate_size, linear)
    return w


def _mlp(w: dict[str, np.ndarray], prefix: str, hidden: int, inter: int, linear: Any) -> None:
    w[prefix + "gate_proj.weight"] = linear(inter, hidden)
    w[prefix + "up_proj.weight"] = linear(inter, hidden)
    w[prefix + "down_proj.weight"] = linear(hidden, inter)


def tiny_config() -> ModelConfig:
    return parse_config(tiny_config_dict(), source=TINY_NAME)


def tiny_checkpoint(seed: int = TINY_SEED) -> tuple[ModelConfig, DictWeights]:
    cfg = tiny_config()
    return cfg, DictWeights(tiny_weights(cfg, seed), source=TINY_NAME)


def encode_text(text: str) -> list[int]:
    """UTF-8 bytes of ``text`` as tiny-model token ids."""
    return list(text.encode("utf-8"))

