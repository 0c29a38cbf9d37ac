"""The ``glm_moe_dsa`` (GLM-5.x) parts of a config: defaults, the DSA indexer schedule, MLP layer types.

:func:`kernels.model.config.parse_config` calls these for ``model_type`` ``glm_moe_dsa``; the rest of
the config (MLA sizes, RoPE, router) is read by the shared parser.

- Keys a GLM config leaves out take transformers' ``GlmMoeDsaConfig`` defaults
  (:data:`GLM_DEFAULTS`: they differ from DeepSeek-V3's for the router and the norms).
- Which layers run an indexer ("full") and which reuse the most recent full layer's selection
  ("shared"): ``indexer_types`` (a list) wins; else ``index_topk_pattern`` (a string of F/S, which
  the colibri engine ignores); else the schedule ``index_topk_freq`` / ``index_skip_topk_offset``:
  layer i is full iff ``max(i - offset + 1, 0) % max(freq, 1) == 0`` (offset defaults to 2).
- MLP layer types: ``mlp_layer_types`` ("dense"/"sparse") wins over ``first_k_dense_replace``.

Everything we cannot run exactly is refused in one line naming the key (:class:`UnsupportedModelError`):
a first layer that is shared, unknown type strings or indexer options, a pattern of the wrong
length, non-interleaved RoPE, grouped routing, no q_lora (the indexer reads the q residual).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kernels.errors import FormatError, LimitError, UnsupportedModelError

GLM_MODEL_TYPE = "glm_moe_dsa"

# transformers 5.24.0 GlmMoeDsaConfig defaults for keys whose absence changes behaviour
GLM_DEFAULTS: dict[str, Any] = {
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-5,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# every indexer key we read; any other key starting with "index" is refused by name
INDEXER_KEYS = (
    "index_topk", "index_head_dim", "index_n_heads", "indexer_types", "index_topk_pattern",
    "index_topk_freq", "index_skip_topk_offset", "indexer_rope_interleave",
)
INDEXER_LIMITS = {"index_topk": 1 << 24, "index_head_dim": 1 << 12, "index_n_heads": 1 << 10}
INDEXER_TYPES = ("full", "shared")
MLP_LAYER_TYPES = ("dense", "sparse")
PATTERN_LETTERS = {"F": "full", "S": "shared"}


@dataclass(frozen=True)
class DsaConfig:
    """The DSA indexer of a GLM model: per-layer types and the indexer's sizes."""

    index_topk: int
    index_n_heads: int
    index_head_dim: int
    indexer_types: tuple[str, ...]  # per layer: "full" | "shared"

    @cached_property
    def full_layers(self) -> tuple[int, ...]:
        """Layers that run (and store the keys of) an indexer, ascending (computed once: every step
        asks, through the file's dims)."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def n_index_layers(self) -> int:
        return len(self.full_layers)

    def is_full(self, layer: int) -> bool:
        return self.indexer_types[layer] == "full"


def with_glm_defaults(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy of the config with transformers' GLM defaults for the keys it leaves out."""
    return {**GLM_DEFAULTS, **obj}


def refuse_glm_unsupported(obj: dict[str, Any], source: str) -> None:
    """Refuse what the GLM decoder cannot run exactly, naming the key."""
    where = f"{source}: {GLM_MODEL_TYPE}"
    if obj.get("q_lora_rank") is None:
        raise UnsupportedModelError(f"{where} without q_lora_rank is not supported (the indexer reads the q residual)")
    if obj.get("rope_interleave", True) is not True:
        raise UnsupportedModelError(f"{where} rope_interleave={obj['rope_interleave']!r} is not supported"
                                    " (GLM rotates interleaved pairs)")
    if obj.get("indexer_rope_interleave", True) is not True:
        raise UnsupportedModelError(f"{where} indexer_rope_interleave={obj['indexer_rope_interleave']!r}"
                                    " is not supported (GLM's indexer rotates interleaved pairs)")
    for key in ("n_group", "topk_group"):
        if obj.get(key) != 1:
            raise UnsupportedModelError(f"{where} {key}={obj.get(key)!r} is not supported (GLM routes in one group)")
    rope = obj.get("rope_parameters")
    factor = rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict) else 1.0
    if factor not in (1, 1.0, None):
        raise UnsupportedModelError(f"{where} rope_parameters.partial_rotary_factor={factor!r} is not supported")
    for key in obj:
        if key.startswith("index") and key not in INDEXER_KEYS:
            raise UnsupportedModelError(f"{where} indexer option {key!r} is not supported")


def mlp_layer_types(obj: dict[str, Any], source: str, n_layers: int) -> tuple[str, ...]:
    """Per layer "dense" | "sparse": ``mlp_layer_types`` or the first ``first_k_dense_replace`` dense."""
    types = obj.get("mlp_layer_types")
    if types is None:
        first = obj.get("first_k_dense_replace")
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise FormatError(f"{source}: first_k_dense_replace must be an integer >= 0, found {first!r}")
        n_dense = min(first, n_layers)
        return ("dense",) * n_dense + ("sparse",) * (n_layers - n_dense)
    return _type_list(types, "mlp_layer_types", MLP_LAYER_TYPES, source, n_layers)


def parse_dsa(obj: dict[str, Any], source: str, n_layers: int, qk_rope: int) -> DsaConfig:
    """The indexer sizes and per-layer types, checked (layer 0 must be full)."""
    sizes = {key: _positive(obj, key, source) for key in INDEXER_LIMITS}
    if sizes["index_head_dim"] < qk_rope:
        raise UnsupportedModelError(f"{source}: index_head_dim={sizes['index_head_dim']} is smaller than"
                                    f" qk_rope_head_dim={qk_rope} (the indexer ropes its first qk_rope dims)")
    types = _indexer_types(obj, source, n_layers)
    if types and types[0] != "full":
        keys = ("indexer_types", "index_topk_pattern", "index_skip_topk_offset")
        key = next((k for k in keys if obj.get(k) is not None), "indexer_types")
        raise UnsupportedModelError(f"{source}: layer 0 is 'shared' ({key}): a shared layer needs an earlier full one")
    return DsaConfig(sizes["index_topk"], sizes["index_n_heads"], sizes["index_head_dim"], types)


def _indexer_types(obj: dict[str, Any], source: str, n_layers: int) -> tuple[str, ...]:
    if obj.get("indexer_types") is not None:
        return _type_list(obj["indexer_types"], "indexer_types", INDEXER_TYPES, source, n_layers)
    pattern = obj.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, list):
            return _type_list(pattern, "index_topk_pattern", INDEXER_TYPES, source, n_layers)
        if not isinstance(pattern, str) or any(c not in PATTERN_LETTERS for c in pattern):
            raise UnsupportedModelError(f"{source}: index_topk_pattern must be a string of F/S, found {pattern!r}")
        if len(pattern) != n_layers:
            raise UnsupportedModelError(
                f"{source}: index_topk_pattern has {len(pattern)} letters for {n_layers} layers")
        return tuple(PATTERN_LETTERS[c] for c in pattern)
    freq = _schedule_int(obj, "index_topk_freq", 1, source)
    offset = _schedule_int(obj, "index_skip_topk_offset", 2, source)
    freq = max(freq, 1)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers))


def _type_list(value: object, key: str, allowed: tuple[str, ...], source: str, n_layers: int) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise FormatError(f"{source}: {key} must be a list of {'/'.join(allowed)}, found {value!r}")
    bad = next((v for v in value if v not in allowed), None)
    if bad is not None:
        raise UnsupportedModelError(f"{source}: {key} entry {bad!r} is not supported (only {', '.join(allowed)})")
    if len(value) != n_layers:
        raise UnsupportedModelError(f"{source}: {key} has {len(value)} entries for {n_layers} layers")
    return tuple(value)


def _positive(obj: dict[str, Any], key: str, source: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FormatError(f"{source}: {key} must be an integer >= 1, found {value!r}")
    if value > INDEXER_LIMITS[key]:
        raise LimitError(f"{source}: {key}={value} exceeds the limit {INDEXER_LIMITS[key]}")
    return value


def _schedule_int(obj: dict[str, Any], key: str, default: int, source: str) -> int:
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > 1 << 20:
        raise FormatError(f"{source}: {key} must be an integer, found {value!r}")
    return value
