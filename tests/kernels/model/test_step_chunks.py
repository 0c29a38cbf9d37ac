"""Chunked prefill is exact: a prompt's rows (latent and indexer) and the logits of the token that
follows are bitwise the same whether the prompt is fed in one piece, in chunks of any size, token
by token, or in chunks that share batched steps (:meth:`MLADecoder.step`) with other sessions'
decode tokens and prefill chunks, on either side of the GLM indexer's ``index_topk``."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.errors import FormatError
from kernels.model import DecoderCache, MLADecoder, load_model

PROMPT_LEN = 41  # crosses the tiny GLM's index_topk (16)


@pytest.fixture(scope="module")
def models(tiny_glm_dir: Path) -> dict[str, MLADecoder]:
    return {"deepseek": load_model("tiny"), "glm": load_model(tiny_glm_dir)}


def _prompt(model: MLADecoder, seed: int, n: int = PROMPT_LEN) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, n).astype(np.int32)  # [n] i32


def _fed_in_pieces(model: MLADecoder, kv: str, prompt: np.ndarray, cuts: list[int]) -> tuple[DecoderCache, np.ndarray]:
    """``prompt[:-1]`` fed in the pieces ``cuts`` make, then its last token as a single step."""
    cache = model.new_cache(kv)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < prompt.size - 1)), prompt.size - 1]
    for a, b in zip(bounds, bounds[1:], strict=False):
        model.forward(prompt[a:b], cache)
    return cache, model.forward(prompt[-1:], cache)[0]  # [V] f32


def _same_rows(a: DecoderCache, b: DecoderCache) -> bool:
    ra, rb = a.records_since(0), b.records_since(0)
    pairs = [(ra.tokens, rb.tokens), (ra.index, rb.index)]
    for name in ("lc", "rc", "lc_codes", "rc_codes", "lc_scale", "rc_scale"):
        pairs.append((getattr(ra, name), getattr(rb, name)))
    return all((x is None and y is None) or np.array_equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("name", ["deepseek", "glm"])
@pytest.mark.parametrize("kv", ["f32", "fp8", "int4"])
def test_a_prompt_in_any_pieces_gives_the_same_rows_and_logits(models: dict[str, MLADecoder], name: str,
                                                               kv: str) -> None:
    model = models[name]
    prompt = _prompt(model, 1)
    whole, logits = _fed_in_pieces(model, kv, prompt, [])
    for cuts in ([1], [7, 16, 17], [15, 16, 33], list(range(1, PROMPT_LEN - 1)), [39]):
        cache, got = _fed_in_pieces(model, kv, prompt, cuts)
        assert _same_rows(cache, whole), f"rows differ for cuts {cuts}"
        assert np.array_equal(got, logits), f"logits differ for cuts {cuts}"


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_chunks_sharing_steps_with_other_sessions_are_exact(models: dict[str, MLADecoder], data: st.DataObject) -> None:
    """Several prompts admitted chunk by chunk in shared steps, beside sessions that decode: each
    prompt's rows and next-token logits equal its one-piece prefill's, and each decoding session's
    logits equal its step alone."""
    model = models[data.draw(st.sampled_from(["deepseek", "glm"]), label="model")]
    kv = data.draw(st.sampled_from(["f32", "fp8"]), label="kv")
    prompts = [_prompt(model, 10 + i, data.draw(st.integers(2, 45), label=f"len{i}")) for i in range(2)]
    refs = [_fed_in_pieces(model, kv, p, []) for p in prompts]
    decoders = []  # sessions that decode one token a step beside the prompts
    for i in range(2):
        cache = model.new_cache(kv)
        model.forward(_prompt(model, 20 + i, 5 + 13 * i), cache)
        decoders.append(cache)
    live = [model.new_cache(kv) for _ in prompts]
    fed = [0, 0]
    budget = data.draw(st.integers(1, 20), label="budget")
    while any(fed[i] < prompts[i].size - 1 for i in range(2)):
        caches, tokens, counts = [], [], []
        for cache in decoders:
            token = int(data.draw(st.integers(0, model.config.vocab_size - 1), label="token"))
            alone = model.new_cache(kv)  # the decoding session's step alone, on a copy of its rows
            model.forward(cache.tokens, alone)
            want = model.forward(np.array([token], np.int32), alone)[0]
            caches.append(cache)
            tokens.append([token])
            counts.append(1)
            cache.expected = want  # type: ignore[attr-defined]
        left = budget
        for i, prompt in enumerate(prompts):
            take = min(left, prompt.size - 1 - fed[i])
            if take > 0:
                caches.append(live[i])
                tokens.append(list(prompt[fed[i] : fed[i] + take]))
                counts.append(take)
                fed[i] += take
                left -= take
        logits = model.step(caches, np.concatenate([np.asarray(t, np.int32) for t in tokens]), counts)  # [B, V]
        for b, cache in enumerate(decoders):
            assert np.array_equal(logits[b], cache.expected)  # type: ignore[attr-defined]
    for i, prompt in enumerate(prompts):
        got = model.forward(prompt[-1:], live[i])[0]
        assert _same_rows(live[i], refs[i][0]) and np.array_equal(got, refs[i][1])


def test_step_refusals_change_no_cache(models: dict[str, MLADecoder]) -> None:
    model = models["glm"]
    a, b = model.new_cache("fp8"), model.new_cache("fp8")
    model.forward(_prompt(model, 3, 6), a)
    with pytest.raises(FormatError, match="token counts"):
        model.step([a, b], np.array([1, 2, 3], np.int32), [1, 1])
    with pytest.raises(FormatError, match="token counts"):
        model.step([a, b], np.array([1, 2], np.int32), [2, 0])
    with pytest.raises(FormatError, match="twice"):
        model.step([a, a], np.array([1, 2, 3], np.int32), [1, 2])
    assert (a.length, b.length) == (6, 0)


@pytest.mark.parametrize("name", ["deepseek", "glm"])
def test_a_forward_s_last_logits_are_the_steps(models: dict[str, MLADecoder], name: str) -> None:
    """The last position of a multi-token forward gives bitwise the logits its single-token step gives."""
    model = models[name]
    prompt = _prompt(model, 5)
    whole = model.forward(prompt, model.new_cache("fp8"))[-1]  # [V]
    _, stepped = _fed_in_pieces(model, "fp8", prompt, [])
    assert np.array_equal(whole, stepped)
