"""The GLM-5.x (``glm_moe_dsa``) decoder against Hugging Face transformers' GlmMoeDsaForCausalLM.

Small random checkpoints are built with transformers (seeded), saved as safetensors and loaded by
our loader. The DSA indexer runs with ``index_topk`` far below the context, so selection, sparse
attention and shared layers all matter. Three ways of naming the layer types are covered: an
explicit ``indexer_types`` list, the freq/offset schedule and an ``index_topk_pattern`` (for the
last two the list transformers writes back is removed from config.json, so OUR reading of the
schedule/pattern is what runs). f32 rows: teacher-forced top-1 and logits, the stored Lc/Rc/Ic rows
against transformers' cache (``indexer_keys`` for Ic), the selections against transformers' own
top-k, and greedy generation. fp8 rows: greedy tokens against transformers with every latent cache
update passed through the engine's row quantizer (the indexer keys stay f32, as in the file).

Ties in the top-k are implementation-defined (transformers' ``topk`` vs the engine's rule), so the
seeds are chosen with a clear margin between the k-th and (k+1)-th score, and the test asserts it.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

NO_ORACLE = "the oracle extra is not installed: pip install -e '.[oracle]'"
torch = pytest.importorskip("torch", reason=NO_ORACLE)
transformers = pytest.importorskip("transformers", reason=NO_ORACLE)
GlmMoeDsaConfig = transformers.GlmMoeDsaConfig
GlmMoeDsaForCausalLM = transformers.GlmMoeDsaForCausalLM
from transformers import cache_utils  # noqa: E402

import kernels.model.glm_decoder as glm_decoder  # noqa: E402
from kernels.attention import index_scores  # noqa: E402
from kernels.fp8 import dequantize_rows, quantize_rows  # noqa: E402
from kernels.model import GlmDecoder, generate, load_model  # noqa: E402
from tests.support.model_views import is_fp8  # noqa: E402

pytestmark = pytest.mark.oracle

torch.set_num_threads(2)

BASE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=24,
    v_head_dim=16, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    index_n_heads=16, index_head_dim=32, index_topk=8, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


@dataclass(frozen=True)
class Case:
    name: str
    overrides: dict
    seed: int
    drop_types: bool = False  # remove indexer_types from config.json: our schedule/pattern reading runs
    dtype: torch.dtype = torch.float32
    shard: str | None = None


CASES = [
    Case("explicit-types-moe-theta8e6", dict(
        num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"], first_k_dense_replace=1,
        rope_parameters={"rope_type": "default", "rope_theta": 8e6}), seed=21),
    Case("schedule-mlp-types-yarn-bias", dict(
        num_hidden_layers=5, index_topk_freq=2, index_skip_topk_offset=1, index_topk=6,
        mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse"], attention_bias=True,
        rope_parameters=YARN), seed=22, drop_types=True),
    Case("pattern-bf16-sharded-tied", dict(
        num_hidden_layers=4, index_topk_pattern="FFSS", first_k_dense_replace=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 8e6}), seed=23, drop_types=True,
        dtype=torch.bfloat16, shard="200KB"),
]

GAINS = {"lm_head": 4.0, "o_proj": 0.3, "q_b_proj": 2.0, "kv_b_proj": 2.0, "gate.weight": 2.0}


def _rescale(model: GlmMoeDsaForCausalLM, seed: int) -> None:
    """Weights with wide next-token margins: ~unit-gain projections, norms near 1, a live router."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("inv_freq"):
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # [.., out, in] weights
                gain = next((v for k, v in GAINS.items() if k in name), 1.0)
                p.copy_(noise * gain / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Case, Path]]:
    case: Case = request.param
    torch.manual_seed(case.seed)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**{**BASE, **case.overrides})).eval()
    _rescale(model, case.seed)
    out = tmp_path_factory.mktemp(case.name)
    kwargs = {"max_shard_size": case.shard} if case.shard else {}
    model.to(case.dtype).save_pretrained(out, **kwargs)
    if case.shard:
        assert (out / "model.safetensors.index.json").exists(), "the bf16 case must exercise a sharded checkpoint"
    if case.drop_types:
        cfg = json.loads((out / "config.json").read_text())
        cfg.pop("indexer_types")
        (out / "config.json").write_text(json.dumps(cfg))
    yield case, out


def _hf_model(path: Path) -> GlmMoeDsaForCausalLM:
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # exactly N tokens
    return model


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, BASE["vocab_size"], size=n).astype(np.int64)


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def _teacher_forced(model: GlmDecoder, tokens: np.ndarray, kv: str, prefill: int) -> tuple[np.ndarray, object]:
    cache = model.new_cache(kv)
    parts = [model.forward(tokens[:prefill], cache)]
    parts += [model.forward(tokens[i : i + 1], cache) for i in range(prefill, tokens.size)]
    return np.concatenate(parts), cache


@pytest.fixture
def recorded_selections(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Every selection our decoder makes (a forward's rows past index_topk, prefill and decode alike,
    in one select_step call per full layer): (first query position, selection [S, k], scores [S, T])."""
    calls: list[tuple[int, np.ndarray, np.ndarray]] = []

    def recording_step(qi, weights, key_blocks_of, k):  # the step's selector
        sel = original_step(qi, weights, key_blocks_of, k)
        first = sum(int(blk.shape[0]) for blk in key_blocks_of[0]) - 1  # the first query's own position
        last_keys = key_blocks_of[-1]  # a forward's rows are consecutive positions of one cache
        calls.append((first, sel, index_scores(qi, weights, last_keys, first)))
        return sel

    original_step = glm_decoder.select_step
    monkeypatch.setattr(glm_decoder, "select_step", recording_step)
    return calls


def test_config_parsed_as_transformers_reads_it(checkpoint: tuple[Case, Path]) -> None:
    case, path = checkpoint
    hf_cfg = _hf_model(path).config
    cfg = load_model(path).config
    assert cfg.model_type == "glm_moe_dsa" and cfg.dsa is not None
    assert ("indexer_types" in json.loads((path / "config.json").read_text())) != case.drop_types
    assert list(cfg.dsa.indexer_types) == list(hf_cfg.indexer_types)
    assert "shared" in cfg.dsa.indexer_types
    assert list(cfg.mlp_layer_types or ()) == list(hf_cfg.mlp_layer_types)
    assert [cfg.is_moe_layer(i) for i in range(cfg.n_layers)] == [t == "sparse" for t in hf_cfg.mlp_layer_types]
    assert cfg.dsa.index_topk == hf_cfg.index_topk and cfg.rope.theta == hf_cfg.rope_parameters["rope_theta"]


def test_f32_rows_selections_and_logits_match_transformers(checkpoint: tuple[Case, Path], recorded_selections) -> None:
    case, path = checkpoint
    hf, ours = _hf_model(path), load_model(path)
    assert isinstance(ours, GlmDecoder)
    tokens = _tokens(40, case.seed)
    hf_sel: list[np.ndarray] = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, i, o: hf_sel.append(o[0].numpy()))
             for layer in hf.model.layers if layer.self_attn.indexer is not None]
    try:
        with torch.no_grad():
            out = hf(torch.from_numpy(tokens)[None], use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    ref = out.logits[0].numpy()  # [T, V]
    logits, cache = _teacher_forced(ours, tokens, "f32", prefill=24)  # the step that runs (compiled where it applies)
    recorded_selections.clear()  # the compiled step selects inside its one compiled call: the reference step
    ours.use_compiled = False  # records them, and is bitwise the compiled one
    ref_logits, ref_cache = _teacher_forced(ours, tokens, "f32", prefill=24)
    assert np.array_equal(logits, ref_logits)
    assert np.array_equal(cache.records_since(0).lc, ref_cache.records_since(0).lc)
    assert np.array_equal(logits.argmax(-1), ref.argmax(-1)), "teacher-forced top-1 differs"
    assert _rel_err(logits, ref) < 1e-4
    rec = cache.records_since(0)  # lc [T, L, kv_lora], rc [T, L, rope], index [T, NI, hd]
    full = ours.dsa.full_layers
    assert rec.index is not None and rec.index.shape == (40, len(full), BASE["index_head_dim"])
    for layer in range(ours.config.n_layers):
        hf_layer = out.cache.layers[layer]
        assert _rel_err(rec.lc[:, layer], hf_layer.keys[0, 0].numpy()) < 1e-4, f"Lc layer {layer}"
        assert _rel_err(rec.rc[:, layer], hf_layer.values[0, 0].numpy()) < 1e-4, f"Rc layer {layer}"
    for slot, layer in enumerate(full):
        ref_ic = out.cache.layers[layer].indexer_keys[0].numpy()  # [T, hd]
        assert _rel_err(rec.index[:, slot], ref_ic) < 1e-4, f"Ic layer {layer}"
    # selections: ours (prefill of 24, then one per step) against transformers' one 40-token pass
    k = ours.dsa.index_topk
    n_forwards = 1 + 16
    assert len(recorded_selections) == n_forwards * len(full), "one selection per full layer per forward"
    for n, (first, sel, scores) in enumerate(recorded_selections):
        ref_sel = hf_sel[n % len(full)]  # [40, k]: transformers' top-k of full layer n % len(full)
        for s in range(sel.shape[0]):
            pos = first + s
            ordered = np.sort(scores[s, : pos + 1])[::-1]
            assert ordered[k - 1] - ordered[k] > 1e-4 * np.abs(ordered).max(), "seed without a clear top-k margin"
            assert np.array_equal(sel[s], np.sort(ref_sel[pos])), f"selection at position {pos}"


def test_f32_greedy_generation_matches_transformers(checkpoint: tuple[Case, Path]) -> None:
    case, path = checkpoint
    hf, ours = _hf_model(path), load_model(path)
    prompt = _tokens(8, case.seed + 100)
    with torch.no_grad():
        ref = hf.generate(torch.from_numpy(prompt)[None], max_new_tokens=40, do_sample=False, pad_token_id=2)
    got = generate(ours, ours.new_cache("f32"), prompt, 40).tokens
    assert got == ref[0, prompt.size :].tolist()


def _qdq(t: torch.Tensor) -> torch.Tensor:
    """Rows [..., n] through our fp8 row quantizer and back (what an fp8 cache stores)."""
    x = t.detach().to(torch.float32).numpy()
    codes, scales = quantize_rows(np.ascontiguousarray(x.reshape(-1, x.shape[-1])))
    return torch.from_numpy(dequantize_rows(codes, scales).reshape(x.shape)).to(t.dtype)


@pytest.fixture
def hf_fp8_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' latent cache updates (Lc, k_rot) quantized before they are stored or attended."""
    original = cache_utils.DynamicIndexedLayer.update

    def quantized_update(self, key_states, value_states, *args, **kwargs):
        return original(self, _qdq(key_states), _qdq(value_states), *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicIndexedLayer, "update", quantized_update)


def test_fp8_greedy_matches_transformers_with_quantized_cache(checkpoint: tuple[Case, Path], hf_fp8_cache) -> None:
    case, path = checkpoint
    hf, ours = _hf_model(path), load_model(path)
    prompt = _tokens(8, case.seed + 200)
    tokens = _tokens(40, case.seed + 300)
    with torch.no_grad():
        ref = hf.generate(torch.from_numpy(prompt)[None], max_new_tokens=40, do_sample=False, pad_token_id=2)
        out = hf(torch.from_numpy(tokens)[None], use_cache=True)
    got = generate(ours, ours.new_cache("fp8"), prompt, 40).tokens
    assert got == ref[0, prompt.size :].tolist()
    logits, cache = _teacher_forced(ours, tokens, "fp8", prefill=16)
    rec = cache.records_since(0)
    assert is_fp8(rec) and rec.index is not None and rec.index.dtype == np.float32
    assert np.array_equal(logits.argmax(-1), out.logits[0].numpy().argmax(-1)), "fp8 top-1 vs quantized HF"
    assert _rel_err(logits, out.logits[0].numpy()) < 1e-3
    lc0 = dequantize_rows(rec.lc_codes[:, 0], rec.lc_scale[:, 0])  # [T, kv_lora] f32
    assert _rel_err(lc0, out.cache.layers[0].keys[0, 0].numpy()) < 1e-3, "the quantized Lc rows transformers used"
