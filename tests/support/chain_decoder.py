"""A stand-in decoder for the engine loop's tests: its logits after feeding token t to cache c are
one-hot at (k t + c.id + c.length) % vocab, so a row computed out of order, twice or in the wrong
cache changes the tokens a greedy draw picks. A test records what it needs of each step through
:meth:`ChainDecoder.on_step` (each step's size, its members)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class ChainCache:
    """A stand-in cache: an id and a length (each token fed adds one), truncated as a session's is."""

    def __init__(self, cache_id: int) -> None:
        self.id, self.length = cache_id, 0

    def truncate(self, n: int) -> int:
        self.length = max(0, min(n, self.length))
        return self.length


class ChainDecoder:
    """The stand-in decoder (``k``: the token's factor; ``vocab``: the logits' width). It checks
    nothing (every id and every length is fine); :meth:`on_step` runs before each batched step."""

    def __init__(self, k: int, vocab: int) -> None:
        self.k, self.vocab = k, vocab

    def on_step(self, caches: Sequence[ChainCache], counts: Sequence[int]) -> None:
        """Called with each step's caches and their token counts, before it runs (a test records them)."""

    def check_tokens(self, tokens: np.ndarray) -> np.ndarray:
        return np.asarray(tokens, np.int32)

    def check_room(self, cache: object, n: int) -> None:
        return None

    def row(self, token: int, cache: ChainCache) -> np.ndarray:
        """Feed ``token`` to ``cache``: its logits [V] f32."""
        cache.length += 1
        row = np.zeros(self.vocab, np.float32)  # [V] f32
        row[(self.k * token + cache.id + cache.length) % self.vocab] = 1.0
        return row

    def forward(self, tokens: np.ndarray, cache: ChainCache) -> np.ndarray:
        return np.stack([self.row(int(t), cache) for t in tokens])  # [S, V] f32

    def step(self, caches: list[ChainCache], tokens: np.ndarray, counts: list[int]) -> np.ndarray:
        """Each cache's run of ``tokens`` fed in order; the logits of each one's last: [B, V] f32."""
        self.on_step(caches, counts)
        rows, start = [], 0
        for cache, count in zip(caches, counts, strict=True):
            rows.append([self.row(int(t), cache) for t in tokens[start : start + count]][-1])
            start += count
        return np.stack(rows)  # [B, V] f32


def greedy(logits: np.ndarray, position: int) -> int:
    """The argmax of ``logits`` [V] (a draw that ignores its position)."""
    return int(np.argmax(logits))


def start_logits(i: int, vocab: int) -> np.ndarray:
    """The logits [V] f32 a prompt left turn ``i``: one-hot at i % vocab."""
    row = np.zeros(vocab, np.float32)  # [V] f32
    row[i % vocab] = 1.0
    return row
