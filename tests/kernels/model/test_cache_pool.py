"""Stateless turns' pooled caches (kernels.model.cache_pool): a cache given back is wiped in place
(length 0, every owned array zero over its whole capacity, its address tables still its own) and
a step over it gives bitwise the logits and tokens a fresh cache gives, whatever the request
before it held; the pool drops what it should not hold."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels.model import DecoderCache, MLADecoder, load_model
from kernels.model.cache_pool import CachePool
from kernels.rows import Fp8Rows


@pytest.fixture(scope="module")
def glm(tiny_glm_dir: Path) -> MLADecoder:
    return load_model(tiny_glm_dir)


def _greedy(model: MLADecoder, cache: DecoderCache, prompt: np.ndarray, n: int) -> tuple[list[int], np.ndarray]:
    """``n`` greedy tokens after ``prompt`` [S] i32, one batched step each: (the tokens, every
    step's logits [n, V] f32)."""
    logits = model.step([cache], prompt, [prompt.shape[0]])  # [1, V]
    tokens, rows = [], [logits[0]]
    for _ in range(n - 1):
        tokens.append(int(np.argmax(logits[0])))
        logits = model.step([cache], np.asarray(tokens[-1:], np.int32), [1])
        rows.append(logits[0])
    tokens.append(int(np.argmax(logits[0])))
    return tokens, np.stack(rows)


def _owned_arrays(cache: DecoderCache) -> list[np.ndarray]:
    layers, keys, _ = cache.owned_storage()
    return [arr for own in layers for arr in own.values()] + list(keys)


@pytest.mark.parametrize("kv_dtype", ["fp8", "f32", "int4"])
def test_a_pooled_cache_steps_bitwise_like_a_fresh_one_and_keeps_nothing(glm: MLADecoder, kv_dtype: str) -> None:
    rng = np.random.default_rng(7)
    vocab = glm.config.vocab_size
    before = rng.integers(0, vocab, 90).astype(np.int32)  # a longer request first: its storage grows past 64 rows
    prompt = rng.integers(0, vocab, 7).astype(np.int32)
    pool = CachePool(lambda: glm.new_cache(kv_dtype))
    first = pool.take()
    _greedy(glm, first, before, 12)
    tables = first.row_tables()
    pool.give_back(first)
    assert len(pool) == 1 and first.length == 0 and first.tokens.shape == (0,)
    assert all(not arr.any() for arr in _owned_arrays(first))  # nothing of the last request, written or not
    reused = pool.take()
    assert reused is first and len(pool) == 0
    assert reused.row_tables() is tables  # the same arrays: its address tables are not built again
    got = _greedy(glm, reused, prompt, 10)
    want = _greedy(glm, glm.new_cache(kv_dtype), prompt, 10)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])  # bitwise, every step's logits
    np.testing.assert_array_equal(reused.records_since(0).tokens, prompt.tolist() + want[0][:-1])


def test_the_pool_drops_what_it_should_not_hold(glm: MLADecoder) -> None:
    pool = CachePool(lambda: glm.new_cache("fp8"), keep=2, max_bytes=1 << 30)
    caches = [pool.take() for _ in range(3)]
    assert len({id(c) for c in caches}) == 3  # an empty pool makes new ones
    for cache in caches:
        pool.give_back(cache)
    assert len(pool) == 2  # full: the third is dropped
    small = CachePool(lambda: glm.new_cache("fp8"), max_bytes=0)
    small.give_back(small.take())  # grew past max_bytes (any storage at all, here)
    assert len(small) == 0
    grown = glm.new_cache("fp8")
    glm.forward(np.arange(5, dtype=np.int32), grown)
    rec = grown.records_since(0)
    blocks = [[Fp8Rows(lc_codes=rec.lc_codes[:, i], lc_scale=rec.lc_scale[:, i],  # type: ignore[index]
                       rc_codes=rec.rc_codes[:, i], rc_scale=rec.rc_scale[:, i])]  # type: ignore[index]
              for i in range(grown.n_layers)]
    resumed = glm.cache_from_blocks(blocks, rec.tokens, kv_dtype="fp8", index_rows=rec.index)
    pool.take()
    pool.give_back(resumed)  # base rows (a session's): never pooled
    pool.give_back(object())  # no DecoderCache: dropped, nothing raised
    assert len(pool) == 1 and resumed.length == 5
