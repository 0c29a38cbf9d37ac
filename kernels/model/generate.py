"""Prompt prefill + decode loop over a :class:`DecoderCache`.

The prompt is fed in one forward pass, then each sampled token is fed alone. Exactly
``max_new`` tokens are produced unless ``stop_at_eos`` ends the run at an eos token. The LAST
sampled token is returned but not fed: its rows do not exist yet (the engine's rule), so a
session that continues later feeds it first.

Callbacks let a session persist as it goes: ``on_rows(start, stop)`` after every forward pass
(positions [start, stop) now hold rows in the cache: ``cache.records_since(start)``), and
``on_token(token, position)`` for every sampled token (``position`` is where it will sit).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kernels.errors import FormatError, LimitError
from kernels.model.cache import DecoderCache
from kernels.model.decoder import MLADecoder
from kernels.model.sampling import Sampler

OnRows = Callable[[int, int], None]
OnToken = Callable[[int, int], None]
TokenPicker = Callable[[np.ndarray, int], int]  # (logits [V], position) -> token; a Sampler is one


@dataclass
class GenerateResult:
    tokens: list[int] = field(default_factory=list)  # sampled tokens, in order
    stopped_at_eos: bool = False
    prompt_positions: int = 0  # rows the prompt added


def generate(
    model: MLADecoder,
    cache: DecoderCache,
    prompt_ids: Sequence[int] | np.ndarray,
    max_new: int,
    sampler: TokenPicker | None = None,
    stop_at_eos: bool = False,
    on_token: OnToken | None = None,
    on_rows: OnRows | None = None,
) -> GenerateResult:
    """Feed ``prompt_ids`` after the cache's rows, then sample ``max_new`` tokens."""
    sampler = sampler or Sampler()
    prompt = model.check_tokens(np.asarray(prompt_ids, dtype=np.int64).reshape(-1))  # [P] i32
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
        raise FormatError(f"max_new must be an integer >= 0, found {max_new!r}")
    if prompt.size == 0:
        raise FormatError("the prompt is empty: at least one token must be fed to get next-token logits")
    # the last sampled token is never fed, so the cache ends at length + P + max_new - 1
    end = cache.length + prompt.size + max(max_new - 1, 0)
    if end > model.config.max_position_embeddings:
        raise LimitError(
            f"{cache.length} cached + {prompt.size} prompt + {max_new} new tokens exceed the model's context"
            f" of {model.config.max_position_embeddings} positions"
        )
    eos = set(model.config.eos_token_ids)
    result = GenerateResult(prompt_positions=int(prompt.size))
    feed = prompt
    while True:
        start = cache.length
        logits = model.forward(feed, cache)  # [n, V] f32
        if on_rows is not None:
            on_rows(start, cache.length)
        if len(result.tokens) == max_new:
            return result
        position = cache.length
        token = sampler(logits[-1], position)
        result.tokens.append(token)
        if on_token is not None:
            on_token(token, position)
        if len(result.tokens) == max_new or (stop_at_eos and token in eos):
            result.stopped_at_eos = stop_at_eos and token in eos
            return result
        feed = np.array([token], dtype="<i4")
