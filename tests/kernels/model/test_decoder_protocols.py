"""kernels.model.protocols: the concrete decoder, cache and config satisfy the seam sessions use.

Statically, ``mypy kernels`` checks it (kernels/model/__init__.py); the typed assignments below say
the same to mypy when it reads this file. At runtime the protocols are runtime_checkable, and a
turn written only against them (the sessions' feeding policy) runs the tiny model.
"""
from __future__ import annotations

from typing import TypeVar

import numpy as np
import pytest

from kernels.model import Decoder, DecoderCache, DecoderConfig, LatentCache, MLADecoder
from kernels.rows import RecordRows

C = TypeVar("C", bound=LatentCache)
PROMPT = np.array([72, 101, 108, 108, 111, 44, 32], dtype=np.int64)



def feed(decoder: Decoder[C], cache: C, tokens: np.ndarray) -> np.ndarray:
    """The sessions' policy, through the protocols only: the chunk in one forward; logits [vocab]."""
    toks = decoder.check_tokens(tokens)  # [S] i32
    logits: np.ndarray = decoder.forward(toks, cache)[-1]  # [vocab] f32
    return logits


@pytest.mark.parametrize("kv", ["f32", "fp8"])
def test_the_decoder_its_caches_and_config_conform(model: MLADecoder, kv: str) -> None:
    decoder: Decoder[DecoderCache] = model
    config: DecoderConfig = model.config
    cache: LatentCache = decoder.new_cache(kv)
    assert isinstance(decoder, Decoder)
    assert isinstance(config, DecoderConfig)
    assert isinstance(cache, LatentCache)
    feed(decoder, decoder.new_cache(kv), PROMPT)
    grown = decoder.new_cache(kv)
    feed(decoder, grown, PROMPT)
    n = grown.length
    resumed: LatentCache = decoder.cache_from_blocks(
        [grown.blocks(layer) for layer in range(config.n_layers)], grown.tokens, kv_dtype=kv
    )
    assert isinstance(resumed, LatentCache)
    assert resumed.length == n and np.array_equal(resumed.tokens, PROMPT)
    assert isinstance(resumed.records_since(n - 1), RecordRows)
    assert resumed.truncate(n - 1) == n - 1 and resumed.own_nbytes >= 0


@pytest.mark.parametrize("kv", ["f32", "fp8"])
def test_a_turn_through_the_protocols_is_the_concrete_turn(model: MLADecoder, kv: str) -> None:
    by_protocol = feed(model, model.new_cache(kv), PROMPT)
    cache = model.new_cache(kv)
    model.forward(PROMPT[:-1].astype(np.int32), cache)
    direct = model.forward(PROMPT[-1:].astype(np.int32), cache)[-1]  # [vocab] f32
    assert np.array_equal(by_protocol, direct)


def test_a_cache_missing_a_member_is_not_a_latent_cache(model: MLADecoder) -> None:
    class NoTruncate:
        length = 0
        tokens = np.zeros(0, np.int32)
        own_nbytes = 0

        def blocks(self, layer: int, stop: int | None = None) -> list[object]:
            return []

        def records_since(self, start: int) -> RecordRows:
            return RecordRows(tokens=np.zeros(0, np.int32))

    assert not isinstance(NoTruncate(), LatentCache)
    assert not isinstance(model.new_cache("f32"), Decoder)
