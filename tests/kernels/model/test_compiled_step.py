"""The compiled step (kernels.model.compiled_step): one numba call per step of a GLM-5 or DeepSeek-V3
model (tiny: q_lora, grouped V3 routing, YaRN, interleaved rope) over fp8, f32 or v3 (int4,
PolarQuant) caches on the CPU gives every logit, latent row and indexer key bitwise what the
reference step gives (the numpy decoder, kept as the reference), for fresh and resumed caches,
prefill chunks beside decode tokens, rows on both sides of ``index_topk``, batches that grow the
scratch; each row is what that token alone gives (batch and chunk invariance); batches mixing kv
dtypes and models it cannot pack (attention biases) keep the reference step."""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels.model import DecoderCache, GlmDecoder, MLADecoder, Sampler, generate, load_model, resolve_model
from kernels.model.compiled_step import CompiledStep
from kernels.model.config import parse_config
from kernels.model.packed_weights import packable
from kernels.model.tiny import tiny_config_dict, tiny_weights
from kernels.model.weights import DictWeights
from kernels.rows import F32Rows, Fp8Rows, LatentRows, TqRows

FIELDS_OF = {"fp8": ("tokens", "lc_codes", "lc_scale", "rc_codes", "rc_scale", "index"),
             "f32": ("tokens", "lc", "rc", "index")}
RECORD_FIELDS = FIELDS_OF["fp8"]


@pytest.fixture(scope="module")
def models(tiny_glm_dir: Path) -> dict[str, MLADecoder]:
    return {"glm-mini": load_model(resolve_model("glm-mini")), "tiny-glm": load_model(tiny_glm_dir),
            "deepseek": load_model("tiny")}


@pytest.fixture
def compiled_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows of each compiled step run (a spy on CompiledStep.run)."""
    calls: list[int] = []
    real = CompiledStep.run

    def spy(self: CompiledStep, h: np.ndarray, *args: Any) -> Any:
        calls.append(h.shape[0])
        return real(self, h, *args)

    monkeypatch.setattr(CompiledStep, "run", spy)
    return calls


def _tokens(model: MLADecoder, seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, n).astype(np.int32)  # [n] i32


def _resumed(model: MLADecoder, cache: DecoderCache) -> DecoderCache:
    """A cache over ``cache``'s rows as a file's records hold them: strided, read-only views."""
    rec = cache.records_since(0)
    for name in FIELDS_OF.get(cache.kv_dtype, RECORD_FIELDS)[1:]:
        if getattr(rec, name) is not None:  # (a DeepSeek-V3 model's records have no indexer keys)
            getattr(rec, name).setflags(write=False)
    blocks: list[list[LatentRows]]
    if cache.kv_dtype == "f32":
        blocks = [[F32Rows(lc=rec.lc[:, i], rc=rec.rc[:, i])] for i in range(cache.n_layers)]
    elif rec.codec is not None:  # v3: radii where fp8 keeps its scales
        blocks = [[TqRows(lc_codes=rec.lc_codes[:, i], lc_radius=rec.lc_scale[:, i], rc_codes=rec.rc_codes[:, i],
                          rc_radius=rec.rc_scale[:, i], codec=rec.codec, kv_lora=cache.kv_lora,
                          qk_rope=cache.qk_rope)] for i in range(cache.n_layers)]
    else:
        blocks = [[Fp8Rows(lc_codes=rec.lc_codes[:, i], lc_scale=rec.lc_scale[:, i],
                           rc_codes=rec.rc_codes[:, i], rc_scale=rec.rc_scale[:, i])] for i in range(cache.n_layers)]
    return model.cache_from_blocks(blocks, rec.tokens, kv_dtype=cache.kv_dtype, index_rows=rec.index)


def _run(model: MLADecoder, lengths: list[tuple[int, bool]], steps: list[list[int]],
         kv_dtype: str = "fp8") -> tuple[list[np.ndarray], list[Any]]:
    """Sessions of the given (prompt length, resumed), then steps of the given token counts per
    session: (each step's logits, each session's records)."""
    caches = []
    for i, (n, resumed) in enumerate(lengths):
        cache = model.new_cache(kv_dtype)
        model.forward(_tokens(model, 10 + i, n), cache)
        caches.append(_resumed(model, cache) if resumed else cache)
    logits = [model.step(caches, _tokens(model, 100 + s, sum(counts)), counts) for s, counts in enumerate(steps)]
    return logits, [c.records_since(0) for c in caches]


def _both(model: MLADecoder, run: Callable[[], tuple[list[np.ndarray], list[Any]]],
          fields: tuple[str, ...] = RECORD_FIELDS) -> None:
    """``run`` on the compiled step and on the reference step: bitwise equal logits and records."""
    model.use_compiled = True
    compiled = run()
    model.use_compiled = False
    try:
        reference = run()
    finally:
        model.use_compiled = True
    for a, b in zip(compiled[0], reference[0], strict=True):
        assert np.array_equal(a, b)
    for ra, rb in zip(compiled[1], reference[1], strict=True):
        for name in fields:
            assert np.array_equal(getattr(ra, name), getattr(rb, name)), name


@pytest.mark.parametrize("name", ["glm-mini", "tiny-glm", "deepseek"])
def test_the_compiled_step_is_bitwise_the_reference(models: dict[str, MLADecoder], name: str,
                                                    compiled_calls: list[int]) -> None:
    model = models[name]
    assert packable(model) is None
    lengths = [(3, False), (15, False), (16, True), (31, False), (40, True), (23, False)]
    steps = [[1] * 6, [1, 5, 1, 1, 3, 1], [2, 1, 1, 7, 1, 1], [1] * 6, [1, 1, 1, 1, 1, 40]]
    _both(model, lambda: _run(model, lengths, steps))
    assert len(compiled_calls) >= len(steps), "the compiled step did not run"


def test_a_growing_batch_and_cache_keep_their_bits(models: dict[str, MLADecoder], compiled_calls: list[int]) -> None:
    model = models["glm-mini"]  # a step of 1, then of 9 (the scratch grows), past owned capacity (64 rows)
    steps = [[1, 1, 1], [4, 1, 4], [1, 3, 70], [1] * 3]
    _both(model, lambda: _run(model, [(60, False), (62, True), (5, False)], steps))
    assert max(compiled_calls) >= 74


@pytest.mark.parametrize("name", ["glm-mini", "deepseek"])
def test_each_row_is_what_its_token_alone_gives(models: dict[str, MLADecoder], name: str,
                                                compiled_calls: list[int]) -> None:
    """Batch and chunk invariance on the compiled step: a session's logits and rows are the same
    alone, beside others, prompt fed whole, in chunks or token by token."""
    model = models[name]
    prompt = _tokens(model, 5, 45)  # crosses index_topk (32)
    alone = model.new_cache("fp8")
    whole = model.forward(prompt, alone)[-1]
    chunked = model.new_cache("fp8")
    for a, b in ((0, 7), (7, 8), (8, 33), (33, 45)):
        last = model.forward(prompt[a:b], chunked)[-1]
    assert np.array_equal(last, whole)
    by_token = model.new_cache("fp8")
    others = [model.new_cache("fp8") for _ in range(5)]
    for o, n in zip(others, (1, 9, 33, 50, 2), strict=True):
        model.forward(_tokens(model, n, n), o)
    for i, token in enumerate(prompt):
        batch = [*others[: i % 6], by_token]
        logits = model.step(batch, np.array([*(_tokens(model, i, len(batch) - 1)), token], np.int32),
                            [1] * len(batch))
    assert np.array_equal(logits[-1], whole)
    for x, y in ((alone, chunked), (alone, by_token)):
        rx, ry = x.records_since(0), y.records_since(0)
        for name in RECORD_FIELDS:
            assert np.array_equal(getattr(rx, name), getattr(ry, name)), name
    assert compiled_calls


def test_greedy_tokens_are_the_references(models: dict[str, MLADecoder], compiled_calls: list[int]) -> None:
    model = models["glm-mini"]
    for seed in (1, 2, 3):
        prompt = _tokens(model, 1000 + seed, 12 + 9 * seed)
        outs = []
        for use in (True, False):
            model.use_compiled = use
            outs.append(generate(model, model.new_cache("fp8"), prompt, 24, sampler=Sampler(temperature=0.0)).tokens)
        model.use_compiled = True
        assert list(outs[0]) == list(outs[1])
    assert compiled_calls


@pytest.mark.parametrize(("name", "kv_dtype"), [("glm-mini", "f32"), ("tiny-glm", "f32"), ("glm-mini", "int4"),
                                                ("glm-mini", "polar3"), ("deepseek", "f32"), ("deepseek", "int4")])
def test_the_compiled_step_over_other_kv_dtypes_is_bitwise_the_reference(models: dict[str, MLADecoder], name: str,
                                                                         kv_dtype: str,
                                                                         compiled_calls: list[int]) -> None:
    """f32 (v1) and v3 caches: every logit, row (v3: codes and radii) and key, fresh and resumed."""
    model = models[name]
    lengths = [(3, False), (31, True), (40, False), (23, True)]
    steps = [[1] * 4, [1, 5, 1, 3], [2, 1, 7, 1], [1, 1, 1, 40]]
    _both(model, lambda: _run(model, lengths, steps, kv_dtype=kv_dtype), FIELDS_OF.get(kv_dtype, RECORD_FIELDS))
    assert len(compiled_calls) >= len(steps), "the compiled step did not run"


@pytest.mark.parametrize(("name", "kv_dtype"), [("glm-mini", "fp8"), ("glm-mini", "f32"), ("glm-mini", "int4"),
                                                ("glm-mini", "polar4"), ("deepseek", "fp8"), ("deepseek", "f32")])
def test_a_row_is_the_same_alone_and_in_a_batch_of_three(models: dict[str, MLADecoder], name: str, kv_dtype: str,
                                                         compiled_calls: list[int]) -> None:
    """Batch invariance of each kv dtype the compiled step takes: a session's logits and rows are
    bitwise the same stepped alone and beside two others (one of them taking a prefill chunk)."""
    model = models[name]
    runs = []
    for company in ([], [(9, False), (36, True)]):
        steps = [[1] * (1 + len(company))] * 2 + [[1, 4, 1][: 1 + len(company)]]
        logits, records = _run(model, [(34, False), *company], steps, kv_dtype=kv_dtype)
        runs.append(([x[0] for x in logits], records[0]))
    for a, b in zip(runs[0][0], runs[1][0], strict=True):
        assert np.array_equal(a, b)
    for name in FIELDS_OF.get(kv_dtype, RECORD_FIELDS):
        assert np.array_equal(getattr(runs[0][1], name), getattr(runs[1][1], name)), name
    assert compiled_calls == [34, 1, 1, 1, 34, 9, 36, 3, 3, 6], "a step did not take the compiled step"


def test_other_caches_and_models_keep_the_reference_step(models: dict[str, MLADecoder],
                                                         compiled_calls: list[int]) -> None:
    glm = models["glm-mini"]
    mixed = [glm.new_cache(kv) for kv in ("fp8", "f32", "int4", "polar4")]
    for cache in mixed:
        glm.forward(_tokens(glm, 3, 5), cache)
    compiled_calls.clear()
    glm.step(mixed, _tokens(glm, 4, 4), [1, 1, 1, 1])
    glm.step(mixed[2:], _tokens(glm, 5, 2), [1, 1])  # two v3 codecs
    assert compiled_calls == [], "a batch mixing kv dtypes took the compiled step"
    deepseek = models["deepseek"]
    assert not isinstance(deepseek, GlmDecoder) and deepseek.compiled_step() is not None
    biased = _deepseek_with_attention_biases()
    assert packable(biased) is not None and biased.compiled_step() is None
    caches = [biased.new_cache("fp8") for _ in range(2)]
    biased.step(caches, _tokens(biased, 6, 4), [3, 1])
    assert compiled_calls == [], "a model the packer refuses took the compiled step"


def _deepseek_with_attention_biases() -> MLADecoder:
    """tiny's DeepSeek-V3 with (seeded) attention biases, which the compiled step does not take."""
    raw = {**tiny_config_dict(), "attention_bias": True}
    cfg = parse_config(raw, source="tiny-biased")
    weights = tiny_weights(cfg)
    rng = np.random.RandomState(7)
    for i in range(cfg.n_layers):
        for name, n in (("q_a_proj", cfg.q_lora_rank), ("kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                        ("o_proj", cfg.hidden_size)):
            weights[f"model.layers.{i}.self_attn.{name}.bias"] = (rng.standard_normal(n) * 0.02).astype(np.float32)
    return MLADecoder(cfg, DictWeights(weights, source="tiny-biased"))


def test_threads_stepping_one_model_keep_their_bits(models: dict[str, MLADecoder]) -> None:
    """Two threads stepping their own sessions of one model at once (each has its own scratch)."""
    model = models["glm-mini"]
    want = _run(model, [(20, False), (35, False)], [[1, 1]] * 8)
    got: list[Any] = [None, None]

    def work(i: int) -> None:
        got[i] = _run(model, [(20, False), (35, False)], [[1, 1]] * 8)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in got:
        for a, b in zip(result[0], want[0], strict=True):
            assert np.array_equal(a, b)
