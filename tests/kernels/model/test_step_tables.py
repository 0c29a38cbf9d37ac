"""The vectorised step (kernels.model.step_tables): a batch of fp8 caches on the CPU is written,
selected and attended in one compiled call per layer through address tables, and every logit,
latent row and indexer key is bitwise what the session-by-session path gives: fresh and resumed
caches (strided, read-only rows, as a file's mapping), prefill chunks beside decode tokens, caches
on either side of the GLM indexer's ``index_topk`` and caches whose storage grows mid-step."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels.model import DecoderCache, MLADecoder, load_model
from kernels.model.compiled_step import COMPILED_KINDS
from kernels.model.step_tables import StepTables
from kernels.rows import Fp8Rows


@pytest.fixture(scope="module")
def models(tiny_glm_dir: Path) -> dict[str, MLADecoder]:
    return {"deepseek": load_model("tiny"), "glm": load_model(tiny_glm_dir)}


def _tokens(model: MLADecoder, seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, n).astype(np.int32)  # [n] i32


def _resumed(model: MLADecoder, cache: DecoderCache) -> DecoderCache:
    """A cache over ``cache``'s rows as a file's records hold them: per-layer strided, read-only views."""
    rec = cache.records_since(0)
    for arr in (rec.lc_codes, rec.lc_scale, rec.rc_codes, rec.rc_scale, rec.index):
        if arr is not None:  # (a model without an indexer has no index rows)
            arr.setflags(write=False)
    blocks = [[Fp8Rows(lc_codes=rec.lc_codes[:, i], lc_scale=rec.lc_scale[:, i],  # type: ignore[index]
                       rc_codes=rec.rc_codes[:, i], rc_scale=rec.rc_scale[:, i])]  # type: ignore[index]
              for i in range(cache.n_layers)]
    return model.cache_from_blocks(blocks, rec.tokens, kv_dtype="fp8", index_rows=rec.index)


def _session(model: MLADecoder, seed: int, n: int, resumed: bool = False) -> DecoderCache:
    cache = model.new_cache("fp8")
    model.forward(_tokens(model, seed, n), cache)
    return _resumed(model, cache) if resumed else cache


def _run(model: MLADecoder, lengths: list[tuple[int, bool]], steps: list[list[int]]) -> tuple[list[Any], list[Any]]:
    """Sessions of the given (length, resumed), then steps of the given token counts per session:
    (each step's logits, each session's records)."""
    caches = [_session(model, 10 + i, n, resumed) for i, (n, resumed) in enumerate(lengths)]
    logits = []
    for s, counts in enumerate(steps):
        logits.append(model.step(caches, _tokens(model, 100 + s, sum(counts)), counts))
    return logits, [c.records_since(0) for c in caches]


def _both_paths(monkeypatch: pytest.MonkeyPatch, run: Callable[[], tuple[list[Any], list[Any]]]) -> None:
    """``run`` with the tables (checking they were used) and with the session loop: bitwise equal."""
    built: list[StepTables | None] = []
    real = StepTables.of

    def spy(caches: Any, counts: Any, *kinds: Any) -> StepTables | None:
        built.append(real(caches, counts, *kinds))
        return built[-1]

    monkeypatch.setattr(StepTables, "of", spy)
    vector = run()
    assert built and all(t is not None for t in built), "the step did not take the tables"
    monkeypatch.setattr(StepTables, "of", lambda caches, counts, *kinds: None)
    loop = run()
    for a, b in zip(vector[0], loop[0], strict=True):
        assert np.array_equal(a, b)
    for ra, rb in zip(vector[1], loop[1], strict=True):
        for name in ("tokens", "lc_codes", "lc_scale", "rc_codes", "rc_scale", "index"):
            x, y = getattr(ra, name), getattr(rb, name)
            assert (x is None and y is None) or np.array_equal(x, y), name


@pytest.mark.parametrize("name", ["glm", "deepseek"])
def test_a_vectorised_step_is_bitwise_the_session_loop(models: dict[str, MLADecoder], name: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model = models[name]
    lengths = [(3, False), (15, False), (16, True), (17, False), (40, True), (23, False)]
    steps = [[1] * 6, [1, 5, 1, 1, 3, 1], [2, 1, 1, 7, 1, 1], [1] * 6]  # decode tokens and prefill chunks
    _both_paths(monkeypatch, lambda: _run(model, lengths, steps))


def test_a_cache_that_grows_mid_step_keeps_its_rows(models: dict[str, MLADecoder],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    model = models["glm"]
    lengths = [(60, False), (62, True), (5, False)]  # owned capacity starts at 64 rows
    _both_paths(monkeypatch, lambda: _run(model, lengths, [[9, 1, 1], [1, 3, 70], [1, 1, 1]]))


def test_other_kv_dtypes_keep_the_session_loop(models: dict[str, MLADecoder]) -> None:
    model = models["glm"]
    fp8, f32 = model.new_cache("fp8"), model.new_cache("f32")
    model.forward(_tokens(model, 1, 4), fp8)
    model.forward(_tokens(model, 2, 4), f32)
    assert StepTables.of([fp8], [1]) is not None
    assert StepTables.of([fp8, f32], [1, 1]) is None
    assert StepTables.of([f32], [1]) is None  # the reference step's batch kernels read fp8 rows only
    compiled = StepTables.of([f32], [1], COMPILED_KINDS)  # the compiled step's take f32 rows too, never mixed
    assert compiled is not None and compiled.kv_dtype == "f32"
    assert StepTables.of([fp8, f32], [1, 1], COMPILED_KINDS) is None
