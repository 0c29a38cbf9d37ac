"""The rows of one batched decode step: a cache whose only new position this step is, or a
:class:`StepPosition` per position of a cache that takes several (a prefill chunk beside other
sessions' decode tokens); and the write of a step's new rows to each of them."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernels.model.cache import DecoderCache
from kernels.rows import LatentRows


class StepPosition:
    """Pending position ``cache.length + offset`` of ``cache``, as one row of a batched step that
    carries several new positions of that cache (a prefill chunk beside other sessions' decode
    tokens). It reads and writes as ``cache`` itself would in a decode step of that one token,
    with every position before it committed: ``length`` is its position, ``blocks`` and
    ``index_blocks`` stop right after it, and its rows go to that pending position. A step's
    arithmetic per row depends only on these, so a prompt's rows are bitwise the same however it
    is cut into chunks (or fed one token per step)."""

    def __init__(self, cache: DecoderCache, offset: int) -> None:
        self.cache, self.offset = cache, offset
        self.backend, self.kv_dtype = cache.backend, cache.kv_dtype

    @property
    def length(self) -> int:
        """The positions before this one (as a cache about to step this token holds)."""
        return self.cache.length + self.offset

    def blocks(self, layer: int, stop: int | None = None) -> list[LatentRows]:
        """Rows [0, stop) of ``layer``, by default up to and including this position."""
        return self.cache.blocks(layer, self.length + 1 if stop is None else stop)

    def index_blocks(self, slot: int, stop: int | None = None) -> list[np.ndarray]:
        """Indexer keys [0, stop) of full layer number ``slot``, by default up to this position."""
        return self.cache.index_blocks(slot, self.length + 1 if stop is None else stop)

    def encode_rows(self, layer: int, lc: np.ndarray, rc: np.ndarray) -> dict[str, np.ndarray]:
        return self.cache.encode_rows(layer, lc, rc)

    def write_step_row(self, layer: int, values: dict[str, np.ndarray], i: int) -> None:
        self.cache.write_step_row(layer, values, i, self.offset)

    def write_index_row(self, slot: int, keys: np.ndarray, i: int) -> None:
        self.cache.write_index_row(slot, keys, i, self.offset)


StepRow = DecoderCache | StepPosition  # one row of a batched step: a cache's only new position, or one of several


def step_rows_of(caches: Sequence[DecoderCache], counts: Sequence[int]) -> list[StepRow]:
    """The rows of a step in which cache b takes ``counts[b]`` new positions: the cache itself
    where it takes one, else one :class:`StepPosition` per position, in order."""
    rows: list[StepRow] = []
    for cache, count in zip(caches, counts, strict=True):
        rows.extend([cache] if count == 1 else [StepPosition(cache, j) for j in range(count)])
    return rows


def write_step_rows(caches: Sequence[StepRow], layer: int, lc: np.ndarray, rc: np.ndarray) -> None:
    """Row b of lc [B, kv_lora], rc [B, qk_rope] f32 to cache b's pending position: the rows of
    caches of one kv dtype encoded in one call (encoding is per row, so each row's bytes are
    what its cache alone would write)."""
    groups: dict[str, list[int]] = {}
    for b, cache in enumerate(caches):
        groups.setdefault(cache.kv_dtype, []).append(b)
    for members in groups.values():
        rows = np.asarray(members)  # rows: [n] batch rows of this kv dtype
        values = caches[members[0]].encode_rows(layer, lc[rows], rc[rows])  # {field: [n, ...]}
        for i, b in enumerate(members):
            caches[b].write_step_row(layer, values, i)


__all__ = ["StepPosition", "StepRow", "step_rows_of", "write_step_rows"]
