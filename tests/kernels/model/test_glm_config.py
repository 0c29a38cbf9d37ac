"""glm_moe_dsa config parsing: layer types as transformers derives them, GLM defaults, refusals by key."""
from __future__ import annotations

import pytest

from kernels.errors import FormatError, LimitError, UnsupportedModelError
from kernels.model.config import parse_config
from kernels.model.tiny_glm import tiny_glm_config_dict


def cfg(**changes):
    d = tiny_glm_config_dict()
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def schedule(n_layers: int, **keys):
    """A config whose layer types come from the schedule (no list, no pattern)."""
    return cfg(num_hidden_layers=n_layers, indexer_types=None, mlp_layer_types=None, **keys)


def test_tiny_glm_config_resolves() -> None:
    c = parse_config(cfg())
    assert c.model_type == "glm_moe_dsa" and c.dsa is not None
    assert c.dsa.indexer_types == ("full", "shared", "full", "shared")
    assert c.dsa.full_layers == (0, 2) and c.dsa.n_index_layers == 2 and c.dsa.full_layers.index(2) == 1
    assert (c.dsa.index_topk, c.dsa.index_n_heads, c.dsa.index_head_dim) == (16, 16, 32)
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, True, False]
    assert c.rope.rope_type == "default" and c.rope.theta == 8e6 and c.rope_interleave
    assert c.file_dims == (4, 64, 16, 32, 2, 260)  # the .coli_kv header: index_head_dim, full layers


def test_deepseek_v3_file_dims_carry_no_indexer() -> None:
    from kernels.model.tiny import tiny_config

    assert tiny_config().file_dims == (3, 64, 16, 0, 0, 260)


@pytest.mark.parametrize(
    "n_layers, keys, full",
    [
        (4, {}, [0, 1, 2, 3]),  # freq 1: every layer
        (6, {"index_topk_freq": 2}, [0, 1, 3, 5]),  # offset 2: max(i - 1, 0) % 2
        (6, {"index_topk_freq": 2, "index_skip_topk_offset": 1}, [0, 2, 4]),
        (6, {"index_topk_freq": 0}, [0, 1, 2, 3, 4, 5]),  # freq < 1 counts as 1
        (78, {"index_topk_freq": 4, "index_skip_topk_offset": 3}, [0, 1, 2, *range(6, 78, 4)]),  # GLM-5.2's 21
    ],
)
def test_schedule_picks_full_layers(n_layers: int, keys: dict, full: list[int]) -> None:
    c = parse_config(schedule(n_layers, **keys))
    assert c.dsa is not None and list(c.dsa.full_layers) == full
    assert all(t == "shared" for i, t in enumerate(c.dsa.indexer_types) if i not in full)


def test_glm_5_2_schedule_has_21_full_layers() -> None:
    c = parse_config(schedule(78, index_topk_freq=4, index_skip_topk_offset=3))
    assert c.dsa is not None and c.dsa.n_index_layers == 21 and c.dsa.full_layers[-1] == 74


def test_pattern_and_precedence() -> None:
    c = parse_config(cfg(indexer_types=None, index_topk_pattern="FFSF"))
    assert c.dsa is not None and c.dsa.indexer_types == ("full", "full", "shared", "full")
    listed = parse_config(cfg(indexer_types=None, index_topk_pattern=["full", "shared", "shared", "full"]))
    assert listed.dsa is not None and listed.dsa.full_layers == (0, 3)
    both = parse_config(cfg(index_topk_pattern="FFFF", index_topk_freq=2))  # the list wins
    assert both.dsa is not None and both.dsa.full_layers == (0, 2)
    over_schedule = parse_config(cfg(indexer_types=None, index_topk_pattern="FSSS", index_topk_freq=1))
    assert over_schedule.dsa is not None and over_schedule.dsa.full_layers == (0,)


def test_glm_defaults_are_transformers_defaults() -> None:
    d = cfg(mlp_layer_types=None, first_k_dense_replace=None, norm_topk_prob=None, routed_scaling_factor=None,
            rms_norm_eps=None, n_shared_experts=None, index_topk=None, index_n_heads=None, index_head_dim=None,
            num_hidden_layers=5, indexer_types=None)
    c = parse_config(d)
    assert [c.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]  # 3 dense layers
    assert c.norm_topk_prob and c.routed_scaling_factor == 2.5 and c.rms_norm_eps == 1e-5
    assert c.n_shared_experts == 1
    assert c.dsa is not None and (c.dsa.index_topk, c.dsa.index_n_heads, c.dsa.index_head_dim) == (2048, 32, 128)


def test_first_k_dense_replace_when_no_mlp_types() -> None:
    c = parse_config(cfg(mlp_layer_types=None, first_k_dense_replace=1))
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    dense = parse_config(cfg(mlp_layer_types=["dense"] * 4))
    assert not dense.has_moe


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types"),
        ({"indexer_types": None, "index_topk_pattern": "SFFF"}, "index_topk_pattern"),
        ({"indexer_types": None, "index_topk_freq": 2, "index_skip_topk_offset": 0}, "index_skip_topk_offset"),
        ({"indexer_types": ["full", "dense", "full", "full"]}, "indexer_types"),
        ({"indexer_types": ["full", "full"]}, "indexer_types"),
        ({"indexer_types": None, "index_topk_pattern": "FFS"}, "index_topk_pattern"),
        ({"indexer_types": None, "index_topk_pattern": "FFXS"}, "index_topk_pattern"),
        ({"index_topk_offset": 3}, "index_topk_offset"),
        ({"indexer_rope_interleave": False}, "indexer_rope_interleave"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"n_group": 2, "topk_group": 1}, "n_group"),
        ({"topk_group": 2}, "topk_group"),
        ({"mlp_layer_types": ["dense", "moe", "dense", "dense"]}, "mlp_layer_types"),
        ({"mlp_layer_types": ["dense"]}, "mlp_layer_types"),
        ({"index_head_dim": 8}, "index_head_dim"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ({"model_type": "glm4_moe"}, "model_type"),
    ],
)
def test_unsupported_glm_configs_refused_in_one_line_naming_the_key(changes: dict, key: str) -> None:
    with pytest.raises(UnsupportedModelError, match=key) as info:
        parse_config(cfg(**changes), source="x/config.json")
    assert "\n" not in str(info.value) and str(info.value).startswith("x/config.json: ")


@pytest.mark.parametrize(
    "changes, err, key",
    [
        ({"index_topk": 0}, FormatError, "index_topk"),
        ({"index_topk": "16"}, FormatError, "index_topk"),
        ({"index_n_heads": True}, FormatError, "index_n_heads"),
        ({"index_n_heads": 1 << 20}, LimitError, "index_n_heads"),
        ({"index_topk": 1 << 30}, LimitError, "index_topk"),
        ({"indexer_types": "FSFS"}, FormatError, "indexer_types"),
        ({"indexer_types": None, "index_topk_freq": "2"}, FormatError, "index_topk_freq"),
        ({"mlp_layer_types": None, "first_k_dense_replace": -1}, FormatError, "first_k_dense_replace"),
        ({"n_routed_experts": 0}, FormatError, "n_routed_experts"),
    ],
)
def test_malformed_glm_configs_raise_our_errors(changes: dict, err: type, key: str) -> None:
    with pytest.raises(err, match=key):
        parse_config(cfg(**changes))


def test_deepseek_v3_still_refuses_indexer_keys() -> None:
    from kernels.model.tiny import tiny_config_dict

    with pytest.raises(UnsupportedModelError, match="indexer"):
        parse_config({**tiny_config_dict(), "index_topk": 2048})
