"""Parse a Hugging Face ``config.json`` of ``model_type`` ``deepseek_v3`` or ``glm_moe_dsa`` into a checked config.

Only what the reference decoder implements is accepted; everything else is refused BY NAME
(:class:`UnsupportedModelError`): other model types, fp8 block-quantized checkpoints
(``quantization_config``), RoPE scalings other than ``default``/``yarn``, activations other
than ``silu``, V2-style routers, sparse-attention indexers, ... Malformed values raise
:class:`FormatError`; absurd sizes raise :class:`LimitError` before anything is allocated.

Both spellings of the RoPE settings are read: transformers 5 ``rope_parameters`` and the
original checkpoints' ``rope_theta`` + ``rope_scaling``. GLM-5.x (``glm_moe_dsa``) shares this
parser; its defaults, DSA indexer schedule and MLP layer types come from kernels.model.glm_config.
"""
from __future__ import annotations

import builtins
import math
import os
from dataclasses import dataclass, field
from typing import Any

from kernels.errors import FormatError, LimitError, NotFoundError, UnsupportedModelError
from kernels.jsonfile import read_json_bounded
from kernels.model import glm_config as glm_parts
from kernels.model.glm_config import GLM_MODEL_TYPE, DsaConfig

SUPPORTED_MODEL_TYPE = "deepseek_v3"
SUPPORTED_MODEL_TYPES = (SUPPORTED_MODEL_TYPE, GLM_MODEL_TYPE)
CONFIG_MAX_BYTES = 4 << 20  # a config.json is a few KiB; refuse to read more than this
SUPPORTED_ROPE_TYPES = ("default", "yarn")

# Upper bounds on declared sizes: far above any real MLA model, low enough that a hostile config cannot make us
# allocate absurd arrays.
LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "moe_intermediate_size": 1 << 18,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "kv_lora_rank": 1 << 14,
    "q_lora_rank": 1 << 16,
    "qk_rope_head_dim": 1 << 12,
    "qk_nope_head_dim": 1 << 12,
    "v_head_dim": 1 << 12,
    "n_routed_experts": 1 << 12,
    "max_position_embeddings": 1 << 24,
}


@dataclass(frozen=True)
class RopeConfig:
    """RoPE settings after defaults are resolved (as transformers resolves them)."""

    rope_type: str  # "default" | "yarn"
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """A supported DeepSeek-V3-family MLA model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    rope_interleave: bool
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    model_type: str = SUPPORTED_MODEL_TYPE
    mlp_layer_types: tuple[str, ...] | None = None  # per layer "dense" | "sparse" (GLM); None: first_k_dense
    dsa: DsaConfig | None = None  # the DSA indexer (GLM); None: dense attention everywhere

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.n_routed_experts > 0 and self.mlp_layer_types[layer] == "sparse"
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    @property
    def has_moe(self) -> bool:
        return any(self.is_moe_layer(layer) for layer in range(self.n_layers))

    @property
    def file_dims(self) -> tuple[int, int, int, int, int, int]:
        """(n_layers, kv_lora, qk_rope, index_head_dim, n_index_layers, vocab) of this model's .coli_kv."""
        hd, ni = (self.dsa.index_head_dim, self.dsa.n_index_layers) if self.dsa else (0, 0)
        return (self.n_layers, self.kv_lora_rank, self.qk_rope_head_dim, hd, ni, self.vocab_size)


def load_config(model_dir: str | os.PathLike[str]) -> ModelConfig:
    """Read and check ``<model_dir>/config.json``."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    if not os.path.isdir(model_dir):
        raise NotFoundError(f"{os.fspath(model_dir)}: not a model directory (expected config.json + *.safetensors)")
    try:
        obj = read_json_bounded(path, CONFIG_MAX_BYTES)
    except FileNotFoundError:
        raise NotFoundError(f"{path}: no config.json in the model directory") from None
    return parse_config(obj, source=path)


def parse_config(obj: Any, source: str = "config") -> ModelConfig:
    """Check a parsed ``config.json`` dict and return the resolved :class:`ModelConfig`."""
    if not isinstance(obj, dict):
        raise FormatError(f"{source}: the config must be a JSON object, found {type(obj).__name__}")
    glm = obj.get("model_type") == GLM_MODEL_TYPE
    if glm:
        obj = glm_parts.with_glm_defaults(obj)
    r = _Reader(obj, source)
    _refuse_unsupported(obj, source)

    n_layers = r.int("num_hidden_layers")
    mlp_types = glm_parts.mlp_layer_types(obj, source, n_layers) if glm else None
    heads = r.int("num_attention_heads")
    kv_heads = r.opt_int("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise UnsupportedModelError(
            f"{source}: num_key_value_heads={kv_heads} != num_attention_heads={heads} is not supported"
            " (MLA expands one latent into every head)"
        )
    n_routed = r.opt_int("n_routed_experts", 0, minimum=0) or 0
    first_dense = r.opt_int("first_k_dense_replace", 0, minimum=0) or 0
    has_moe = n_routed > 0 and (first_dense < n_layers if mlp_types is None else "sparse" in mlp_types)
    if mlp_types is not None and "sparse" in mlp_types and not n_routed:
        raise FormatError(f"{source}: mlp_layer_types has 'sparse' layers but n_routed_experts is missing or 0")
    n_group = r.opt_int("n_group", 1) or 1
    topk_group = r.opt_int("topk_group", 1) or 1
    k = r.opt_int("num_experts_per_tok", 1) or 1
    if has_moe:
        _check_router(source, n_routed, n_group, topk_group, k)
    max_pos = r.int("max_position_embeddings")
    cfg = ModelConfig(
        vocab_size=r.int("vocab_size"),
        hidden_size=r.int("hidden_size"),
        intermediate_size=r.int("intermediate_size"),
        n_layers=n_layers,
        num_attention_heads=heads,
        q_lora_rank=r.opt_int("q_lora_rank"),
        kv_lora_rank=r.int("kv_lora_rank"),
        qk_rope_head_dim=r.even_int("qk_rope_head_dim"),
        qk_nope_head_dim=r.int("qk_nope_head_dim"),
        v_head_dim=r.int("v_head_dim"),
        moe_intermediate_size=r.int("moe_intermediate_size") if has_moe else 0,
        n_routed_experts=n_routed if has_moe else 0,
        n_shared_experts=(r.opt_int("n_shared_experts", 0, minimum=0) or 0) if has_moe else 0,
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
        first_k_dense_replace=first_dense,
        norm_topk_prob=r.bool("norm_topk_prob", False),
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0),
        rms_norm_eps=r.float("rms_norm_eps", 1e-6),
        max_position_embeddings=max_pos,
        rope=_parse_rope(obj, source, max_pos),
        rope_interleave=r.bool("rope_interleave", True),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        attention_bias=r.bool("attention_bias", False),
        eos_token_ids=r.token_ids("eos_token_id"),
        bos_token_id=r.opt_int("bos_token_id", minimum=0),
        raw=dict(obj),
        model_type=str(obj["model_type"]),
        mlp_layer_types=mlp_types,
        dsa=glm_parts.parse_dsa(obj, source, n_layers, r.even_int("qk_rope_head_dim")) if glm else None,
    )
    for tok in (*cfg.eos_token_ids, cfg.bos_token_id):
        if tok is not None and tok >= cfg.vocab_size:
            raise FormatError(f"{source}: special token id {tok} is outside the vocabulary [0, {cfg.vocab_size})")
    return cfg


def _refuse_unsupported(obj: dict[str, Any], source: str) -> None:
    model_type = obj.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        only = " or ".join(map(repr, SUPPORTED_MODEL_TYPES))
        raise UnsupportedModelError(f"{source}: model_type {model_type!r} is not supported (only {only})")
    if model_type == GLM_MODEL_TYPE:
        glm_parts.refuse_glm_unsupported(obj, source)
    quant = obj.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        block = quant.get("weight_block_size") if isinstance(quant, dict) else None
        raise UnsupportedModelError(f"{source}: quantized checkpoint (quantization_config.quant_method={method!r}, "
                                    f"weight_block_size={block!r}) is not supported: use a bf16/f16/f32 checkpoint")
    act = obj.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    scoring = obj.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise UnsupportedModelError(f"{source}: scoring_func {scoring!r} is not supported (V3 router: 'sigmoid')")
    topk_method = obj.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise UnsupportedModelError(f"{source}: topk_method {topk_method!r} is not supported (V3 router: 'noaux_tc')")
    freq = obj.get("moe_layer_freq", 1)
    if freq != 1:
        raise UnsupportedModelError(f"{source}: moe_layer_freq={freq!r} is not supported (only 1)")
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        if model_type != GLM_MODEL_TYPE and obj.get(key):
            raise UnsupportedModelError(f"{source}: sparse-attention indexer ({key}) is not supported")
    if obj.get("partial_rotary_factor", 1.0) not in (1, 1.0, None):
        raise UnsupportedModelError(
            f"{source}: partial_rotary_factor={obj['partial_rotary_factor']!r} is not supported"
        )


def _check_router(source: str, n_routed: int, n_group: int, topk_group: int, k: int) -> None:
    if n_routed % n_group:
        raise FormatError(f"{source}: n_routed_experts={n_routed} is not a multiple of n_group={n_group}")
    per_group = n_routed // n_group
    if per_group < 2:
        raise UnsupportedModelError(f"{source}: {per_group} expert per group (n_routed_experts={n_routed},"
                                    f" n_group={n_group}): the V3 group score needs at least 2")
    if topk_group > n_group:
        raise FormatError(f"{source}: topk_group={topk_group} > n_group={n_group}")
    if k > topk_group * per_group:
        raise FormatError(f"{source}: num_experts_per_tok={k} > experts in the {topk_group} chosen groups"
                          f" of {per_group}")


def _parse_rope(obj: dict[str, Any], source: str, max_pos: int) -> RopeConfig:
    params = obj.get("rope_parameters")
    if params is None:
        params = obj.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise FormatError(f"{source}: rope_parameters/rope_scaling must be an object, found {type(params).__name__}")
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(f"{source}: per-layer-type RoPE parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: RoPE scaling type {rope_type!r} is not supported (only {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    r = _Reader(params, f"{source} (rope)")
    theta = params.get("rope_theta", obj.get("rope_theta", 10000.0))
    theta = _Reader({"rope_theta": theta}, source).float("rope_theta", 10000.0)
    if rope_type == "default":
        return RopeConfig(rope_type="default", theta=theta)
    original = obj.get("original_max_position_embeddings", params.get("original_max_position_embeddings", max_pos))
    original = _Reader({"original_max_position_embeddings": original}, source).int("original_max_position_embeddings")
    factor = params.get("factor")
    factor = max_pos / original if factor is None else r.float("factor")
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=r.float("beta_fast", 32.0) or 32.0,
        beta_slow=r.float("beta_slow", 1.0) or 1.0,
        mscale=r.opt_float("mscale"),
        mscale_all_dim=r.opt_float("mscale_all_dim"),
        attention_factor=r.opt_float("attention_factor"),
        truncate=r.bool("truncate", True),
    )


class _Reader:
    """Typed access to config keys; every failure names the source and the key."""

    def __init__(self, obj: dict[str, Any], source: str) -> None:
        self.obj = obj
        self.source = source

    def _bad(self, key: str, what: str) -> FormatError:
        return FormatError(f"{self.source}: {key} must be {what}, found {self.obj.get(key)!r}")

    def int(self, key: str) -> int:
        if key not in self.obj:
            raise FormatError(f"{self.source}: missing required key {key!r}")
        value = self.opt_int(key)
        if value is None:
            raise self._bad(key, "a positive integer")
        return value

    def even_int(self, key: str) -> builtins.int:
        value = self.int(key)
        if value % 2:
            raise self._bad(key, "an even integer")
        return value

    def opt_int(self, key: str, default: builtins.int | None = None, minimum: builtins.int = 1) -> builtins.int | None:
        value = self.obj.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._bad(key, f"an integer >= {minimum}")
        limit = LIMITS.get(key)
        if limit is not None and value > limit:
            raise LimitError(f"{self.source}: {key}={value} exceeds the limit {limit}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.opt_float(key, default)
        if value is None:
            raise self._bad(key, "a number")
        return value

    def opt_float(self, key: str, default: builtins.float | None = None) -> builtins.float | None:
        value = self.obj.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise self._bad(key, "a finite number >= 0")
        return float(value)

    def bool(self, key: str, default: builtins.bool) -> builtins.bool:
        value = self.obj.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def token_ids(self, key: str) -> tuple[builtins.int, ...]:
        value = self.obj.get(key)
        items = [] if value is None else value if isinstance(value, list) else [value]
        if len(items) > 64 or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in items):
            raise self._bad(key, "a token id or a list of token ids")
        return tuple(items)
