"""The batched decode step is batch-invariant: a session's logits, rows and indexer keys from
``decode_step`` are bitwise what its step alone gives, whoever shares the batch, in any order and
at any batch size; and its products are the products (close to an f64 reference)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kernels.errors import FormatError, LimitError
from kernels.model import DecoderCache, MLADecoder, load_model
from kernels.model.rowwise import head_matmul, rowwise_linear

# lengths on both sides of the tiny GLM's index_topk (dense and sparse queries in one batch)
LENGTHS = [1, 2, 5, 15, 16, 17, 23, 31, 32, 33, 40, 47]


@pytest.fixture(scope="module")
def models(tiny_glm_dir: Path) -> dict[str, MLADecoder]:
    return {"deepseek": load_model("tiny"), "glm": load_model(tiny_glm_dir)}


def _caches(model: MLADecoder, kv_dtype: str, rng: np.random.Generator) -> list[DecoderCache]:
    caches = []
    for n in LENGTHS:
        cache = model.new_cache(kv_dtype)
        model.forward(rng.integers(0, model.config.vocab_size, n), cache)
        caches.append(cache)
    return caches


def _step_alone(model: MLADecoder, cache: DecoderCache, token: int) -> tuple[np.ndarray, object, np.ndarray | None]:
    start = cache.length
    logits = model.forward(np.array([token]), cache)[0]  # [V]
    out = (logits, cache.records_since(start), _index_tail(cache, start))
    cache.truncate(start)
    return out


def _index_tail(cache: DecoderCache, start: int) -> np.ndarray | None:
    rows = cache.index_rows()
    return None if rows is None else np.array(rows[start:])


def _same_records(a: object, b: object) -> bool:
    fa, fb = dataclasses.asdict(a), dataclasses.asdict(b)  # type: ignore[call-overload]
    return all((fa[k] is None and fb[k] is None) or np.array_equal(fa[k], fb[k]) for k in fa if k != "codec")


@pytest.mark.parametrize("name", ["deepseek", "glm"])
@pytest.mark.parametrize("kv_dtype", ["f32", "fp8", "int4"])
def test_a_batched_step_is_bitwise_each_sessions_step_alone(models: dict[str, MLADecoder], name: str,
                                                           kv_dtype: str) -> None:
    model = models[name]
    rng = np.random.default_rng(7)
    caches = _caches(model, kv_dtype, rng)
    tokens = rng.integers(0, model.config.vocab_size, len(caches))
    alone = [_step_alone(model, c, int(t)) for c, t in zip(caches, tokens, strict=True)]
    for size in (len(caches), 1, 2, 5, 9):
        members = rng.permutation(len(caches))[:size]  # a random batch, in a random order
        starts = [caches[i].length for i in members]
        logits = model.decode_step([caches[i] for i in members], tokens[members])  # [B, V]
        assert logits.shape == (size, model.config.vocab_size)
        for row, i in enumerate(members):
            want_logits, want_rows, want_index = alone[i]
            assert np.array_equal(logits[row], want_logits), f"{name} {kv_dtype} B={size} cache {i}: logits"
            assert _same_records(caches[i].records_since(starts[row]), want_rows), f"cache {i}: rows"
            got_index = _index_tail(caches[i], starts[row])
            assert (got_index is None and want_index is None) or np.array_equal(got_index, want_index)
        for i, start in zip(members, starts, strict=True):
            caches[i].truncate(start)


def test_a_step_that_cannot_run_changes_no_cache(models: dict[str, MLADecoder]) -> None:
    model = models["glm"]
    rng = np.random.default_rng(3)
    a, b = _caches(model, "fp8", rng)[:2]
    lengths = (a.length, b.length)
    with pytest.raises(FormatError, match="twice"):
        model.decode_step([a, a], np.array([1, 2]))
    with pytest.raises(FormatError, match="2 caches"):
        model.decode_step([a, b], np.array([1]))
    with pytest.raises(FormatError, match="outside the vocabulary"):
        model.decode_step([a, b], np.array([1, model.config.vocab_size]))
    full = model.new_cache("fp8")
    model.forward(rng.integers(0, 50, model.config.max_position_embeddings), full)
    with pytest.raises(LimitError, match="context"):
        model.decode_step([a, full], np.array([1, 2]))
    assert (a.length, b.length) == lengths


@pytest.mark.parametrize(("k", "n"), [(160, 448), (448, 160), (64, 256), (7, 3), (160, 3072), (33, 513),
                                     (1024, 300), (2048, 1031)])  # the last: the threaded panel kernel (over 8 MiB)
def test_rowwise_products_are_invariant_and_accurate(k: int, n: int) -> None:
    rng = np.random.default_rng(k * 1000 + n)
    w = rng.standard_normal((n, k)).astype(np.float32)  # [out, in], as a checkpoint stores it
    x = rng.standard_normal((17, k)).astype(np.float32)
    alone = np.stack([rowwise_linear(x[i : i + 1], w)[0] for i in range(17)])  # [17, n]
    for size in (17, 2, 16):
        rows = rng.permutation(17)[:size]
        assert np.array_equal(rowwise_linear(x[rows], w), alone[rows])
    exact = x.astype(np.float64) @ w.T.astype(np.float64)  # [17, n] f64
    scale = np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64)
    assert np.all(np.abs(alone - exact) <= 4 * k * np.finfo(np.float32).eps * scale)


# the second: 8.4 MB of weights, the threaded panel kernel; the others the single-threaded one
@pytest.mark.parametrize(("k", "n"), [(1024, 300), (2048, 1031), (600, 16), (513, 1), (160, 448)])
def test_rowwise_products_follow_the_stated_arithmetic(k: int, n: int) -> None:
    """Both kernels (the threaded panel one for big weights, the single-threaded one for small)
    compute out[b, n] = ((0 + x[b,0] w[0,n]) + x[b,1] w[1,n]) + ..., a rounded multiply then a
    rounded add, k ascending: numpy's separate f32 ufuncs in that order give the same bits."""
    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((n, k)).astype(np.float32)  # [out, in]
    x = rng.standard_normal((11, k)).astype(np.float32)
    want = np.zeros((11, n), np.float32)  # want: [11, n] f32
    wt = np.ascontiguousarray(w.T)  # [in, out]
    for i in range(k):
        want = want + x[:, i : i + 1] * wt[i]  # [11, n] f32: one rounding each
    assert np.array_equal(rowwise_linear(x, w), want)
    x.flags.writeable = False  # a read-only input is served too
    assert np.array_equal(rowwise_linear(x[3:4], w)[0], want[3])


def test_per_head_products_are_invariant_and_accurate() -> None:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((9, 4, 24)).astype(np.float32)  # [B, H, a]
    w = rng.standard_normal((4, 40, 24)).astype(np.float32)  # [H, b, a]: used transposed
    alone = np.concatenate([head_matmul(x[i : i + 1], w, True, w_transposed=True) for i in range(9)])
    assert np.array_equal(head_matmul(x[::-1], w, True, w_transposed=True), alone[::-1])
    gemm = head_matmul(x, w, False, w_transposed=True)  # the prefill's per-head GEMM
    np.testing.assert_allclose(alone, gemm, rtol=1e-5, atol=1e-5)


def test_read_only_weights_and_inputs_are_served() -> None:
    """A checkpoint's f32 weights are a read-only memory map; the kernels take them as they are."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((40, 24)).astype(np.float32)
    x = rng.standard_normal((3, 24)).astype(np.float32)
    w.flags.writeable = False
    x.flags.writeable = False
    np.testing.assert_allclose(rowwise_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    heads = rng.standard_normal((2, 24, 8)).astype(np.float32)  # [H, a, b]
    heads.flags.writeable = False
    xh = np.ascontiguousarray(np.stack([x[:, :], x[:, ::-1]], axis=1))  # [3, 2, 24]
    np.testing.assert_allclose(head_matmul(xh, heads, True), head_matmul(xh, heads, False), rtol=1e-5, atol=1e-5)
