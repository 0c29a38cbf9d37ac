"""bench.peer_glm52's parts that need no llama.cpp: its checkpoint's config carries GLM-5.2's layer
dims from bench.serve's glm52 case (not invented here) with glm-mini's tokenizer ids, our config
parser reads it; the keys are ours / llama.cpp of the medians; bad arguments: one line, exit 2."""
from __future__ import annotations

import json

import pytest

from bench.peer_glm52 import KEYS, glm52_peer_config, main, ratio_keys
from bench.serve_core import glm52_layers_config
from bench.serve_procs import REPO
from kernels.model.config import parse_config

LAYER_DIMS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads", "q_lora_rank",
              "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_experts_per_tok",
              "index_topk", "index_n_heads", "index_head_dim", "num_hidden_layers")


def test_the_checkpoint_config_has_glm52_layer_dims() -> None:
    mini = json.loads((REPO / "models" / "glm-mini" / "config.json").read_text())
    config = glm52_peer_config(mini, 9)
    dims = glm52_layers_config(9)
    assert {k: config[k] for k in LAYER_DIMS} == {k: dims[k] for k in LAYER_DIMS}
    assert config["n_routed_experts"] == 9 and config["mlp_layer_types"] == ["dense", "sparse"]
    assert (config["vocab_size"], config["eos_token_id"], config["architectures"]) == (
        mini["vocab_size"], mini["eos_token_id"], mini["architectures"])
    parsed = parse_config(config, source="test")
    assert (parsed.hidden_size, parsed.n_layers, parsed.n_routed_experts) == (6144, 2, 9)


def test_keys_are_ours_over_llama_cpp_of_the_medians() -> None:
    ours = [{"solo_tok_s": s, "ttft1_s": 1.0, "agg16_tok_s": 2 * s, "ttft16_s": 2.0} for s in (1.0, 3.0, 5.0)]
    theirs = [{"solo_tok_s": s, "ttft1_s": 0.5, "agg16_tok_s": s, "ttft16_s": 4.0} for s in (2.0, 6.0, 1.0)]
    res = ratio_keys(ours, theirs)
    assert set(KEYS) <= set(res)
    assert res["peer_glm52_solo_tok_s_ratio"] == 3.0 / 2.0
    assert res["peer_glm52_agg16_tok_s_ratio"] == 6.0 / 2.0
    assert res["peer_glm52_ttft1_ratio"] == 2.0 and res["peer_glm52_ttft16_ratio"] == 0.5


@pytest.mark.parametrize("argv", [["--experts", "4"], ["--reps", "0"], ["--tokens", "1"]])
def test_bad_arguments_say_so_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench.peer_glm52:")
