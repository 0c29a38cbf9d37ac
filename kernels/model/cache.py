"""The decoder's latent cache: per-layer Lc/Rc rows in f32, fp8 codes + per-row scales, or v3
4-bit codes + per-row radii (kv dtypes int4, polar2..polar6).

With fp8 or v3 the cache holds ONLY codes and scales (radii), exactly as a ``.coli_kv`` v2 / v3
record does, and new rows are encoded before anything attends to them (prefill included): an
uninterrupted session therefore sees the same numbers as one resumed from the file.

A cache may start from *base blocks* (e.g. memory-mapped views of a file, never copied) and
grows in its own storage after them. Attention reads ``blocks(layer)``: the base blocks
followed by one view of the grown rows.

A DSA model (GLM-5.x) also keeps one indexer key per position for each of its ``n_index_layers``
full layers (the file's Ic rows, always f32): written per forward beside the latent rows,
committed, truncated and discarded with them, resumed from a ``[T, n_index_layers, hd]`` f32 view.

The grown storage is :mod:`kernels.model.cache_owned` (its arrays and block views
:mod:`kernels.model.cache_storage`); the rows of a batched
step (a cache, or one position of a cache that takes several) are :mod:`kernels.model.step_rows`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels.errors import FormatError, ModelMismatchError
from kernels.model.cache_owned import OwnedRows
from kernels.model.cache_storage import (
    FIELDS,
    RECORD_FIELD,
    GrowableIndex,
    GrowableRows,
    check_index_rows,
    row_kind,
    row_width,
    slice_rows,
    window_from,
)
from kernels.model.row_addresses import RowTables
from kernels.rows import F32Rows, Fp8Rows, LatentRows, RecordRows, TqRows


def _resolve_backend(backend: str | Any) -> Any:
    """A backend name ("cpu"/"cuda") -> kernels.backend object; an object with
    ``absorbed_attention`` is used as given."""
    if isinstance(backend, str):
        from kernels.backend import get_backend

        return get_backend(backend)
    return backend


class DecoderCache:
    """Latent rows of every layer for positions [0, length), plus the input token of each
    (and, for a DSA model, the indexer key of each position in every full layer).

    It holds its base blocks (rows it was resumed over, never copied) and its own storage
    (:class:`~kernels.model.cache_owned.OwnedRows`: the rows, keys and tokens it grew, their
    lengths and room), and addresses positions across the two: the decoder's protocol (encode,
    write, commit, discard, truncate), the blocks attention reads, the records a commit takes,
    and the address tables of the batch kernels."""

    def __init__(
        self, n_layers: int, kv_lora: int, qk_rope: int, kv_dtype: str = "f32", backend: str | Any = "cpu",
        *, n_index_layers: int = 0, index_head_dim: int = 0,
    ) -> None:
        self.kind = row_kind(kv_dtype)
        if (n_index_layers > 0) != (index_head_dim > 0) or min(n_index_layers, index_head_dim) < 0:
            raise FormatError(f"index rows: n_index_layers={n_index_layers} with index_head_dim={index_head_dim}")
        self.n_layers, self.kv_lora, self.qk_rope, self.kv_dtype = n_layers, kv_lora, qk_rope, kv_dtype
        self.n_index_layers, self.index_head_dim = n_index_layers, index_head_dim
        self.backend = _resolve_backend(backend)
        self._base: list[list[LatentRows]] = [[] for _ in range(n_layers)]
        self._base_tokens = np.zeros(0, dtype="<i4")  # [base_len] i32
        self._base_index = np.zeros((0, n_index_layers, index_head_dim), np.float32)  # [base_len, NI, hd] f32
        self._base_len = 0
        self._owned = OwnedRows(n_layers, kv_dtype, kv_lora, qk_rope, n_index_layers, index_head_dim)
        self._own = self._owned.layers  # the same lists, named here for the hot paths
        self._own_index = self._owned.index
        self.length = 0
        self._tables: tuple[tuple[int, int], RowTables] | None = None  # (storage key, tables) when built

    # ---- resume -------------------------------------------------------------------------
    @classmethod
    def from_blocks(
        cls,
        per_layer_blocks: Sequence[Sequence[LatentRows]],
        tokens: np.ndarray,
        *,
        kv_lora: int | None = None,
        qk_rope: int | None = None,
        kv_dtype: str | None = None,
        backend: str | Any = "cpu",
        index_rows: np.ndarray | None = None,
        n_index_layers: int = 0,
        index_head_dim: int = 0,
    ) -> DecoderCache:
        """A cache over existing rows (kept as given: views are not copied), one block list per layer.

        ``index_rows``: the indexer keys of those positions, [T, n_index_layers, index_head_dim] f32
        (e.g. a view of a file's Ic rows, not copied); required when ``n_index_layers`` > 0.
        """
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype != np.dtype("<i4"):
            tokens = np.asarray(tokens, dtype="<i4").reshape(-1)
        blocks = [list(layer) for layer in per_layer_blocks]
        first = next((b for layer in blocks for b in layer), None)
        if kv_dtype is None:
            kv_dtype = ("fp8" if isinstance(first, Fp8Rows) else
                        first.codec.kv_dtype if isinstance(first, TqRows) else "f32")
        if first is not None:
            kv_lora = kv_lora or row_width(first, "lc")
            qk_rope = qk_rope or row_width(first, "rc")
        if kv_lora is None or qk_rope is None:
            raise FormatError("from_blocks: no rows to infer kv_lora/qk_rope from; pass them explicitly")
        cache = cls(len(blocks), kv_lora, qk_rope, kv_dtype, backend,
                    n_index_layers=n_index_layers, index_head_dim=index_head_dim)
        cache._base_index = check_index_rows(index_rows, int(tokens.shape[0]), n_index_layers, index_head_dim)
        want = {"f32": F32Rows, "fp8": Fp8Rows, "tq": TqRows}[cache.kind]
        for layer, layer_blocks in enumerate(blocks):
            total = 0
            for b in layer_blocks:
                if not isinstance(b, want) or (isinstance(b, TqRows) and b.codec.kv_dtype != kv_dtype):
                    raise ModelMismatchError(
                        f"layer {layer}: {type(b).__name__} block given to a {kv_dtype} cache"
                        " (a cache reads rows only in the dtype it stores)"
                    )
                if row_width(b, "lc") != kv_lora or row_width(b, "rc") != qk_rope:
                    raise ModelMismatchError(
                        f"layer {layer}: rows of width {row_width(b, 'lc')}/{row_width(b, 'rc')},"
                        f" expected kv_lora={kv_lora}/qk_rope={qk_rope}"
                    )
                total += b.length
            if total != tokens.shape[0]:
                raise FormatError(f"layer {layer}: {total} rows for {tokens.shape[0]} tokens")
        cache._base = blocks
        cache._base_tokens = tokens
        cache._base_len = cache.length = int(tokens.shape[0])
        cache._tables = None
        return cache

    # ---- reading ------------------------------------------------------------------------
    def blocks(self, layer: int, stop: int | None = None) -> list[LatentRows]:
        """Blocks covering positions [0, stop) of ``layer`` (default: every row it holds)."""
        own = self._own[layer]
        stop = self._base_len + own.length if stop is None else stop
        out: list[LatentRows] = []
        pos = 0
        for b in self._base[layer]:
            if pos >= stop:
                break
            out.append(b if pos + b.length <= stop else slice_rows(b, 0, stop - pos))
            pos += b.length
        if stop > self._base_len:
            out.append(own.view(0, stop - self._base_len))
        return out

    def index_blocks(self, slot: int, stop: int | None = None) -> list[np.ndarray]:
        """Indexer keys of full layer number ``slot`` for positions [0, stop): [t, hd] f32 views."""
        own = self._own_index[slot]
        stop = self._base_len + own.length if stop is None else stop
        out: list[np.ndarray] = []
        if self._base_len and stop > 0:
            out.append(self._base_index[: min(stop, self._base_len), slot])  # [t, hd] f32 view
        if stop > self._base_len:
            out.append(own.rows[: stop - self._base_len])  # [t, hd] f32 view
        return out

    def index_rows(self, stop: int | None = None) -> np.ndarray | None:
        """Indexer keys of positions [0, stop) of every full layer: [stop, NI, hd] f32, a view of the
        resumed rows when they cover it (no copy of a file's Ic rows), else a copy; None without."""
        if not self.n_index_layers:
            return None
        stop = self.length if stop is None else stop
        if stop <= self._base_len:
            return self._base_index[:stop]  # [stop, NI, hd] f32 view
        out = np.empty((stop, self.n_index_layers, self.index_head_dim), np.float32)  # [stop, NI, hd] f32
        out[: self._base_len] = self._base_index
        for slot, own in enumerate(self._own_index):
            out[self._base_len :, slot] = own.rows[: stop - self._base_len]
        return out

    @property
    def tokens(self) -> np.ndarray:
        """Input tokens [length] i32 (a copy)."""
        return self.tokens_from(0)

    def tokens_from(self, start: int) -> np.ndarray:
        """Input tokens of positions [start, length) [length - start] i32 (a copy of those only: a
        resumed cache's are a strided view of its file's records, one page apart)."""
        own = self._owned.tokens[max(start - self._base_len, 0) : self.length - self._base_len]
        base = self._base_tokens[min(start, self._base_len) : min(self.length, self._base_len)]
        return np.concatenate([base, own]).astype("<i4", copy=False)  # a new array already

    def records_since(self, start: int) -> RecordRows:
        """Positions [start, length) across all layers, record-major, as the file stores them."""
        if not 0 <= start <= self.length:
            raise FormatError(f"records_since({start}): the cache holds {self.length} positions")
        tokens = self.tokens_from(start)  # [k] i32
        fields: dict[str, Any] = {}  # RecordRows field name -> [k, L, *] array
        codec = self._own[0].codec if self._own else None
        if start == self.length:
            empty = GrowableRows(self.kv_dtype, self.kv_lora, self.qk_rope).arrays
            for name, arr in empty.items():
                fields[RECORD_FIELD.get(name, name)] = np.zeros((0, self.n_layers, *arr.shape[1:]), arr.dtype)
            return RecordRows(tokens=tokens, index=_index_since(self, start), codec=codec, **fields)
        owned = start >= self._base_len  # every asked position is in this cache's own rows (a decode step)
        a, b = start - self._base_len, self.length - self._base_len
        for name in FIELDS[self.kind]:
            if owned:
                per_layer = [own.arrays[name][a:b] for own in self._own]  # each: [k, *] views
            else:
                per_layer = [
                    np.concatenate([getattr(blk, name) for blk in window_from(self.blocks(layer, self.length), start)])
                    for layer in range(self.n_layers)
                ]  # each: [k, *]
            fields[RECORD_FIELD.get(name, name)] = np.stack(per_layer, axis=1)  # [k, L, *] (a new array)
        return RecordRows(tokens=tokens, index=_index_since(self, start), codec=codec, **fields)

    # ---- writing (the decoder's protocol) -------------------------------------------------
    def encode_rows(self, layer: int, lc: np.ndarray, rc: np.ndarray) -> dict[str, np.ndarray]:
        """Rows lc [S, kv_lora], rc [S, qk_rope] f32 in this cache's form (fp8 codes + scales, v3
        codes + radii, or f32), each row encoded on its own: any rows of caches of the same kv
        dtype may be encoded in one call and written row by row."""
        codec = self._own[layer].codec
        if codec is not None:
            lc_codes, lc_radius = codec.encode_rows(np.ascontiguousarray(lc, dtype=np.float32))  # [S, rbL] u8, [S]
            rc_codes, rc_radius = codec.encode_rows(np.ascontiguousarray(rc, dtype=np.float32))  # [S, rbR] u8, [S]
            values = {"lc_codes": lc_codes, "lc_radius": lc_radius, "rc_codes": rc_codes, "rc_radius": rc_radius}
        elif self.kv_dtype == "fp8":
            from kernels.fp8 import quantize_rows

            lc_codes, lc_scale = quantize_rows(np.ascontiguousarray(lc, dtype=np.float32))  # [S, kv_lora] u8, [S]
            rc_codes, rc_scale = quantize_rows(np.ascontiguousarray(rc, dtype=np.float32))  # [S, rope] u8, [S]
            values = {"lc_codes": lc_codes, "lc_scale": lc_scale, "rc_codes": rc_codes, "rc_scale": rc_scale}
        else:
            values = {"lc": lc, "rc": rc}
        return values

    def write_step_row(self, layer: int, values: dict[str, np.ndarray], i: int, offset: int = 0) -> None:
        """Row i of a batch already in this cache's form ({field: [B, *]}, :meth:`encode_rows` of
        several caches' rows) at pending position ``length + offset`` of ``layer`` (a step writes
        a cache's pending positions in order, so the ones before it are written)."""
        self._own[layer].write_row(self.length + offset - self._base_len, values, i)

    def write_index_row(self, slot: int, keys: np.ndarray, i: int, offset: int = 0) -> None:
        """Row i of keys [B, hd] f32 as the indexer key of pending position ``length + offset``."""
        self._own_index[slot].write_row(self.length + offset - self._base_len, keys, i)

    # ---- the batch kernels' view (kernels.model.step_tables) -----------------------------
    def reserve(self, n: int) -> None:
        """Room for ``n`` pending positions in every layer's owned rows and indexer keys, so that
        writing them moves no array (the address tables stay valid through a step)."""
        rows = self.length - self._base_len + n
        if rows > self._owned.room:
            self._owned.reserve(rows)

    def row_tables(self) -> RowTables | None:
        """Address tables of this cache's rows and keys (built once, rebuilt after its storage
        moves); None for rows a table cannot describe."""
        key = (self._base_len, self._owned.moves.count)
        if self._tables is not None and self._tables[0] == key:
            return self._tables[1]
        tables = RowTables.of(self)
        if tables is not None:
            self._tables = (key, tables)
        return tables

    def owned_storage(self) -> tuple[list[dict[str, np.ndarray]], list[np.ndarray], int]:
        """(each layer's owned arrays {field: [capacity, *]}, each full layer's owned keys
        [capacity, hd] f32, the position of owned row 0): the arrays themselves, for address tables."""
        return [own.arrays for own in self._own], [index.rows for index in self._own_index], self._base_len

    def mark_written(self, n: int, *, layer: int | None = None, slot: int | None = None) -> None:
        """The ``n`` pending positions of ``layer``'s rows (or full layer ``slot``'s keys) were
        written in place through the address tables."""
        own: GrowableRows | GrowableIndex = self._own[layer] if layer is not None else self._own_index[slot or 0]
        own.length = self.length - self._base_len + n

    def mark_step_written(self, n: int) -> None:
        """The ``n`` pending positions of every layer's rows and every full layer's keys were
        written in place through the address tables (the compiled step writes them all at once)."""
        self._owned.set_length(self.length - self._base_len + n)

    def commit_positions(self, tokens: np.ndarray) -> None:
        """Make the pending positions (written in every layer) part of the cache."""
        start = self.length - self._base_len
        n = tokens.shape[0]
        lengths = self._owned.lengths()  # every layer's (and full layer's) owned rows
        if min(lengths) != start + n or max(lengths) != start + n:
            raise FormatError("commit_positions: not every layer holds the pending rows")
        self._owned.put_tokens(start, tokens)
        self.length += n

    def discard_pending(self) -> None:
        """Forget rows written after ``length`` (a forward pass that failed part-way)."""
        self._owned.set_length(self.length - self._base_len, shorten_only=True)

    def truncate(self, n: int, *, wipe: bool = False) -> int:
        """Keep positions [0, n) (clamped to ``length``); returns the new length. ``wipe``: every
        owned row past them is zeroed as well, written or not (a cache reused for another request,
        :class:`~kernels.model.cache_pool.CachePool`, keeps nothing of the last one)."""
        if n < 0:
            raise FormatError(f"truncate({n}): a length cannot be negative")
        n = min(n, self.length)
        if n < self._base_len:
            kept: list[list[LatentRows]] = []
            for layer in range(self.n_layers):
                kept.append(self.blocks(layer, n))
            self._base, self._base_len = kept, n
            self._base_tokens = self._base_tokens[:n]
            self._base_index = self._base_index[:n]
            self._tables = None
        self._owned.set_length(n - self._base_len)
        if wipe:
            self._owned.wipe(n - self._base_len)
        self.length = n
        return n

    @property
    def own_nbytes(self) -> int:
        """Bytes of the storage this cache allocated (base blocks not counted)."""
        return self._owned.nbytes


def _index_since(cache: DecoderCache, start: int) -> np.ndarray | None:
    """Indexer keys of positions [start, length) of ``cache``: [k, NI, hd] f32, or None without
    index layers."""
    if not cache.n_index_layers:
        return None
    out = np.empty((cache.length - start, cache.n_index_layers, cache.index_head_dim), np.float32)  # [k, NI, hd]
    for slot in range(cache.n_index_layers):
        pos = 0
        for rows in cache.index_blocks(slot, cache.length):
            lo = max(start - pos, 0)
            if lo < rows.shape[0]:
                out[pos + lo - start : pos + rows.shape[0] - start, slot] = rows[lo:]
            pos += rows.shape[0]
    return out


__all__ = ["DecoderCache"]
