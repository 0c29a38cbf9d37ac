"""The seam between sessions and the decoder, as Protocols (structural: nothing subclasses them).

A session (``sessionstore.sessions``) drives a model and the latent cache the model extends; these
name exactly what it calls, so it can be typed without importing the concrete classes:

- :class:`Decoder`: ``config`` (:class:`DecoderConfig`), ``source``, ``dims_for_file()``,
  ``new_cache()``, ``cache_from_blocks()`` (resume over a file's rows, and its Ic rows for DSA), ``check_tokens()`` and
  ``forward(tokens, cache)``, the one step: S tokens are a prefill, one token a decode step.
- :class:`LatentCache`: ``length``, ``tokens``, ``blocks(layer, stop)``, ``records_since(start)``
  (the rows a writer appends), ``truncate(n)`` and ``own_nbytes`` (its share of a memory budget).

A decoder is generic in its cache: ``forward`` takes only the kind of cache that the same decoder
makes, so :class:`~kernels.model.MLADecoder` is a ``Decoder[DecoderCache]`` (and
:class:`~kernels.model.DecoderCache` a :class:`LatentCache`). Code that holds one decoder and its
caches is written against ``Decoder[C]`` and ``C`` with ``C = TypeVar("C", bound=LatentCache)``.
``mypy kernels`` holds the concrete classes to these (kernels/model/__init__.py); all three are
``runtime_checkable`` for ``isinstance`` in tests (which sees only that the members exist).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from kernels.rows import LatentRows, RecordRows


@runtime_checkable
class DecoderConfig(Protocol):
    """What a session reads of ``model.config``: dimensions and limits."""

    @property
    def n_layers(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


@runtime_checkable
class LatentCache(Protocol):
    """Latent rows of every layer for positions [0, length), plus the input token of each."""

    @property
    def length(self) -> int:
        """Positions held."""
        ...

    @property
    def tokens(self) -> np.ndarray:
        """Input tokens [length] i32 (a copy)."""
        ...

    def tokens_from(self, start: int) -> np.ndarray:
        """Input tokens of positions [start, length) [length - start] i32 (a copy of those only)."""
        ...

    @property
    def own_nbytes(self) -> int:
        """Bytes of the storage the cache allocated itself (rows it resumed over not counted)."""
        ...

    def blocks(self, layer: int, stop: int | None = None) -> list[LatentRows]:
        """Blocks covering positions [0, stop) of ``layer`` (default: every row it holds)."""
        ...

    def index_rows(self, stop: int | None = None) -> np.ndarray | None:
        """Indexer keys of positions [0, stop): [stop, NI, hd] f32 (None for a model without an indexer)."""
        ...

    def records_since(self, start: int) -> RecordRows:
        """Positions [start, length) across all layers, record-major, as the file stores them."""
        ...

    def truncate(self, n: int) -> int:
        """Keep positions [0, n) (clamped to ``length``); returns the new length."""
        ...


CacheT = TypeVar("CacheT", bound=LatentCache)


@runtime_checkable
class Decoder(Protocol[CacheT]):
    """A loaded model as a session drives it; ``CacheT`` is the kind of cache it makes and extends."""

    @property
    def config(self) -> DecoderConfig: ...

    @property
    def source(self) -> str:
        """Where the weights came from (``"tiny"`` or a checkpoint directory)."""
        ...

    def dims_for_file(self) -> tuple[int, int, int, int, int, int]:
        """(n_layers, kv_lora, qk_rope, index_head_dim, n_index_layers, vocab) of this model's .coli_kv."""
        ...

    def new_cache(self, kv_dtype: str = "f32", backend: str | Any = "cpu") -> CacheT:
        """An empty cache of this model's dimensions."""
        ...

    def cache_from_blocks(
        self,
        per_layer_blocks: Sequence[Sequence[LatentRows]],
        tokens: np.ndarray,
        *,
        kv_dtype: str | None = None,
        backend: str | Any = "cpu",
        index_rows: np.ndarray | None = None,
    ) -> CacheT:
        """A cache resuming over existing rows (one block list per layer, zero copy), checked against the model.

        ``index_rows`` [T, n_index_layers, index_head_dim] f32: the file's Ic rows (a view, not copied);
        required by a DSA model (``dims_for_file()[4] > 0``), refused by a model without an indexer.
        """
        ...

    def check_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """tokens as [S] i32, refusing ids outside the vocabulary."""
        ...

    def forward(self, tokens: np.ndarray, cache: CacheT) -> np.ndarray:
        """Run ``tokens`` [S] at positions [cache.length, +S), appending their rows; logits [S, vocab] f32."""
        ...


__all__ = ["CacheT", "Decoder", "DecoderConfig", "LatentCache"]
