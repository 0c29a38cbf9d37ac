"""config.json parsing: supported configs resolve like transformers; the rest is refused by name."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kernels.errors import FormatError, LimitError, NotFoundError, UnsupportedModelError
from kernels.model.config import load_config, parse_config
from kernels.model.rope import inverse_frequencies, softmax_scale, yarn_mscale
from kernels.model.tiny import tiny_config_dict


def cfg(**changes):
    d = tiny_config_dict()
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def test_tiny_config_resolves() -> None:
    c = parse_config(cfg())
    assert (c.n_layers, c.kv_lora_rank, c.qk_rope_head_dim, c.vocab_size) == (3, 64, 16, 260)
    assert c.q_lora_rank == 48 and c.has_moe and not c.is_moe_layer(0) and c.is_moe_layer(1)
    assert c.rope.rope_type == "yarn" and c.rope.factor == 4.0 and c.rope.original_max_position_embeddings == 1024
    assert c.eos_token_id == 257 and c.max_position_embeddings >= 4096


@pytest.mark.parametrize(
    "changes, name",
    [
        ({"model_type": "deepseek_v2"}, "deepseek_v2"),
        ({"model_type": "glm_moe_dsa"}, "glm_moe_dsa"),
        ({"model_type": None}, "None"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "fp8"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
        ({"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"scoring_func": "softmax"}, "softmax"),
        ({"topk_method": "group_limited_greedy"}, "group_limited_greedy"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"index_n_heads": 64, "index_head_dim": 128}, "indexer"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"n_routed_experts": 8, "n_group": 8}, "per group"),
    ],
)
def test_unsupported_configs_refused_by_name(changes: dict, name: str) -> None:
    with pytest.raises(UnsupportedModelError, match=name):
        parse_config(cfg(**changes), source="x/config.json")


@pytest.mark.parametrize(
    "changes, err, text",
    [
        ({"hidden_size": None}, FormatError, "hidden_size"),
        ({"hidden_size": -4}, FormatError, "hidden_size"),
        ({"hidden_size": True}, FormatError, "hidden_size"),
        ({"hidden_size": "64"}, FormatError, "hidden_size"),
        ({"qk_rope_head_dim": 15}, FormatError, "even"),
        ({"vocab_size": 1 << 40}, LimitError, "vocab_size"),
        ({"num_hidden_layers": 100000}, LimitError, "num_hidden_layers"),
        ({"n_group": 3}, FormatError, "multiple of n_group"),
        ({"topk_group": 5}, FormatError, "topk_group"),
        ({"num_experts_per_tok": 9}, FormatError, "num_experts_per_tok"),
        ({"eos_token_id": 999}, FormatError, "outside the vocabulary"),
        ({"eos_token_id": "eos"}, FormatError, "eos_token_id"),
        ({"rms_norm_eps": float("nan")}, FormatError, "rms_norm_eps"),
        ({"rope_interleave": "yes"}, FormatError, "rope_interleave"),
        ({"rope_scaling": [1, 2]}, FormatError, "rope"),
    ],
)
def test_malformed_configs_raise_our_errors(changes: dict, err: type, text: str) -> None:
    with pytest.raises(err, match=text):
        parse_config(cfg(**changes))


def test_non_object_config_refused() -> None:
    with pytest.raises(FormatError, match="JSON object"):
        parse_config([1, 2, 3])


def test_both_rope_spellings_give_the_same_settings() -> None:
    old = parse_config(cfg())  # rope_theta + rope_scaling{"type": ...}
    params = {**tiny_config_dict()["rope_scaling"], "rope_theta": 10000.0}
    params["rope_type"] = params.pop("type")
    new = parse_config(cfg(rope_scaling=None, rope_theta=None, rope_parameters=params))
    assert old.rope == new.rope


def test_yarn_factor_defaults_to_context_ratio() -> None:
    d = cfg(rope_scaling={"type": "yarn", "original_max_position_embeddings": 1024})
    c = parse_config(d)
    assert c.rope.factor == 4096 / 1024


def test_softmax_scale_carries_yarn_mscale_squared() -> None:
    c = parse_config(cfg())
    m = yarn_mscale(4.0, 1.0)
    assert math.isclose(softmax_scale(c), (c.qk_head_dim**-0.5) * m * m, rel_tol=1e-12)
    plain = parse_config(cfg(rope_scaling=None))
    assert softmax_scale(plain) == plain.qk_head_dim**-0.5


def test_yarn_attention_factor_and_ramp() -> None:
    c = parse_config(cfg(rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                                       "mscale": 1.0, "mscale_all_dim": 0.5}))
    inv, factor = inverse_frequencies(c.rope, 16)
    assert math.isclose(factor, yarn_mscale(8.0, 1.0) / yarn_mscale(8.0, 0.5))
    base = 1.0 / 10000.0 ** (2 * np.arange(8) / 16)  # [8] plain RoPE frequencies
    assert abs(inv[0] - base[0]) < 1e-7  # fastest frequencies extrapolate (unchanged)
    assert abs(inv[-1] - base[-1] / 8.0) < 1e-9  # slowest interpolate (divided by the factor)


def test_load_config_errors(tmp_path) -> None:
    with pytest.raises(NotFoundError, match="not a model directory"):
        load_config(tmp_path / "absent")
    with pytest.raises(NotFoundError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b" " * ((4 << 20) + 1))
    with pytest.raises(LimitError, match="larger than"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict()))
    assert load_config(tmp_path).vocab_size == 260


def test_rope_rows_from_the_table_are_the_rows_computed() -> None:
    """Rotary.cos_sin reads rows of a table it grows on demand: bitwise what computing them gives,
    for any positions, in any order, across a growth of the table."""
    import numpy as np

    from kernels.model import load_model

    rotary = load_model("tiny").rotary
    rng = np.random.default_rng(3)
    for positions in (np.array([0]), np.array([5, 1023, 7]), rng.integers(0, 5000, 300), np.arange(0)):
        got, want = rotary.cos_sin(positions), rotary.compute(positions)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
