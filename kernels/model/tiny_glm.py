"""A tiny random ``glm_moe_dsa`` checkpoint directory, written with numpy alone (no torch, no safetensors).

The same byte-level vocabulary and MLA/MoE weight recipe as the embedded ``tiny`` model
(kernels.model.tiny), plus a DSA indexer on layers 0 and 2 (layers 1 and 3 share their selection),
``index_topk`` 16 so that any prompt longer than 16 tokens selects rows, a dense / MoE / MoE /
dense MLP pattern and GLM's default RoPE (theta 8e6). Sessions and CLI tests load it as an
ordinary checkpoint directory (config.json + model.safetensors).
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kernels.model.config import ModelConfig, parse_config
from kernels.model.tiny import BOS_ID, EOS_ID, PAD_ID, tiny_weights

TINY_GLM_SEED = 4321


def tiny_glm_config_dict() -> dict[str, Any]:
    """The tiny GLM model's config.json content (a fresh dict)."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": 260,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
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
        "n_group": 1,
        "topk_group": 1,
        "mlp_layer_types": ["dense", "sparse", "sparse", "dense"],
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 8000000.0},
        "index_topk": 16,
        "index_n_heads": 16,
        "index_head_dim": 32,
        "indexer_types": ["full", "shared", "full", "shared"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
    }


def tiny_glm_config() -> ModelConfig:
    return parse_config(tiny_glm_config_dict(), source="tiny-glm")


def tiny_glm_weights(cfg: ModelConfig, seed: int = TINY_GLM_SEED) -> dict[str, np.ndarray]:
    """Seeded f32 weights under their Hugging Face names: the tiny recipe plus the indexers."""
    assert cfg.dsa is not None and cfg.q_lora_rank is not None  # tiny_glm_config has both
    w = tiny_weights(cfg, seed)
    rng = np.random.RandomState(seed + 1)
    nh, hd = cfg.dsa.index_n_heads, cfg.dsa.index_head_dim

    def linear(out: int, inp: int) -> np.ndarray:
        m: np.ndarray = (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)  # m: [out, in] f32
        return m

    for i in cfg.dsa.full_layers:
        p = f"model.layers.{i}.self_attn.indexer."
        w[p + "wq_b.weight"] = linear(nh * hd, cfg.q_lora_rank)
        w[p + "wk.weight"] = linear(hd, cfg.hidden_size)
        w[p + "k_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
        w[p + "k_norm.bias"] = (0.1 * rng.standard_normal(hd)).astype(np.float32)
        w[p + "weights_proj.weight"] = linear(nh, cfg.hidden_size)
    return w


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray]) -> None:
    """A safetensors file of f32 tensors: u64 header length, JSON header (padded to 8), data."""
    header: dict[str, Any] = {}
    offset = 0
    arrays = {name: np.ascontiguousarray(arr, dtype="<f4") for name, arr in sorted(tensors.items())}
    for name, arr in arrays.items():
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for arr in arrays.values():
            f.write(arr.tobytes())


def write_tiny_glm(directory: str | os.PathLike[str], seed: int = TINY_GLM_SEED) -> Path:
    """config.json + model.safetensors of the tiny GLM model in ``directory`` (created); returns it."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(tiny_glm_config_dict(), indent=1))
    write_safetensors(out / "model.safetensors", tiny_glm_weights(tiny_glm_config(), seed))
    return out
