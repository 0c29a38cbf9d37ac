"""The rows a :class:`~kernels.model.cache.DecoderCache` grew in its own storage after its base
blocks: :class:`OwnedRows`.

Each layer's latent rows (:class:`~kernels.model.cache_storage.GrowableRows`), each full layer's
indexer keys (:class:`~kernels.model.cache_storage.GrowableIndex`) and the input token of each
owned position, in arrays that only grow (doubled when short) and count their moves in one
:class:`~kernels.model.cache_storage.Moves`, so the cache's address tables know when they went
stale. Positions here are owned ones: owned row 0 is the cache's position ``base_len``.
"""
from __future__ import annotations

import numpy as np

from kernels.model.cache_storage import INITIAL_CAPACITY, GrowableIndex, GrowableRows, Moves


class OwnedRows:
    """A cache's own storage: ``layers`` [n_layers] of rows, ``index`` [n_index_layers] of keys,
    ``tokens`` [capacity] i32, and ``room``: the owned rows every one of those arrays has room for."""

    def __init__(self, n_layers: int, kv_dtype: str, kv_lora: int, qk_rope: int, n_index_layers: int,
                 index_head_dim: int) -> None:
        self.moves = Moves()  # reallocations of the arrays below
        self.layers = [GrowableRows(kv_dtype, kv_lora, qk_rope, self.moves) for _ in range(n_layers)]
        self.index = [GrowableIndex(index_head_dim, self.moves) for _ in range(n_index_layers)]
        self.room = INITIAL_CAPACITY  # owned rows every array above has room for (they only grow)
        self.tokens = np.zeros(INITIAL_CAPACITY, dtype="<i4")  # [capacity] i32

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` owned rows in every layer's rows and every full layer's keys."""
        if rows <= self.room:
            return
        for own in self.layers:
            own.reserve(rows)
        for index in self.index:
            index.reserve(rows)
        # the room they have now (each grew by doubling): the next reserves return at once
        self.room = min([next(iter(own.arrays.values())).shape[0] for own in self.layers]
                        + [index.rows.shape[0] for index in self.index])

    def lengths(self) -> list[int]:
        """The owned rows written in each layer, then the owned keys of each full layer."""
        return [own.length for own in self.layers] + [own.length for own in self.index]

    def set_length(self, n: int, shorten_only: bool = False) -> None:
        """Every layer's and full layer's owned length set to ``n`` (or cut to it, ``shorten_only``)."""
        for rows in self.layers:
            rows.length = min(rows.length, n) if shorten_only else n
        for index in self.index:
            index.length = min(index.length, n) if shorten_only else n

    def put_tokens(self, start: int, tokens: np.ndarray) -> None:
        """``tokens`` [n] as the inputs of owned positions [start, start + n) (the array grows)."""
        n = tokens.shape[0]
        if start + n > self.tokens.shape[0]:
            grown = np.zeros(max(2 * self.tokens.shape[0], start + n), dtype="<i4")
            grown[:start] = self.tokens[:start]
            self.tokens = grown
        self.tokens[start : start + n] = tokens

    def wipe(self, start: int) -> None:
        """Every array's rows from owned row ``start`` on zeroed, over its whole capacity (rows a
        failed step wrote past the lengths too), in place: the arrays do not move, so address
        tables built over them stay valid; every length is cut to ``start``."""
        self.set_length(start, shorten_only=True)
        for own in self.layers:
            for arr in own.arrays.values():
                arr[start:] = 0
        for index in self.index:
            index.rows[start:] = 0
        self.tokens[start:] = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the latent rows and indexer keys allocated (tokens not counted)."""
        latent = sum(arr.nbytes for own in self.layers for arr in own.arrays.values())
        return latent + sum(own.rows.nbytes for own in self.index)


__all__ = ["OwnedRows"]
