"""The decoder's latent cache: per-layer Lc/Rc rows in f32, or fp8 codes + per-row scales.

With fp8 the cache holds ONLY codes and scales, exactly as a ``.coli_kv`` v2 record does, and
new rows are quantized before anything attends to them (prefill included): an uninterrupted
session therefore sees the same numbers as one resumed from the file.

A cache may start from *base blocks* (e.g. memory-mapped views of a file, never copied) and
grows in its own storage after them. Attention reads ``blocks(layer)``: the base blocks
followed by one view of the grown rows.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels.errors import FormatError, ModelMismatchError
from kernels.rows import KV_DTYPES, F32Rows, Fp8Rows, LatentRows, RecordRows

_FIELDS = {"f32": ("lc", "rc"), "fp8": ("lc_codes", "lc_scale", "rc_codes", "rc_scale")}
_INITIAL_CAPACITY = 64


def _resolve_backend(backend: str | Any) -> Any:
    """A backend name ("cpu"/"cuda") -> kernels.backend object; an object with
    ``absorbed_attention`` is used as given."""
    if isinstance(backend, str):
        from kernels.backend import get_backend

        return get_backend(backend)
    return backend


class _GrowableRows:
    """One layer's owned rows: arrays with spare capacity, doubled when full."""

    def __init__(self, kv_dtype: str, kv_lora: int, rope: int) -> None:
        self.kv_dtype = kv_dtype
        self.length = 0
        shapes = {"lc": (kv_lora,), "rc": (rope,), "lc_codes": (kv_lora,), "rc_codes": (rope,),
                  "lc_scale": (), "rc_scale": ()}
        dtypes = {"lc": np.float32, "rc": np.float32, "lc_codes": np.uint8, "rc_codes": np.uint8,
                  "lc_scale": np.float32, "rc_scale": np.float32}
        self.arrays = {
            name: np.zeros((_INITIAL_CAPACITY, *shapes[name]), dtype=dtypes[name]) for name in _FIELDS[kv_dtype]
        }  # each: [capacity, *] (f32 rows, u8 codes or f32 scales)

    def write(self, start: int, values: dict[str, np.ndarray]) -> None:
        """Write rows at owned positions [start, start + n) (n = rows in values)."""
        n = next(iter(values.values())).shape[0]
        capacity = next(iter(self.arrays.values())).shape[0]
        if start + n > capacity:
            new_cap = max(2 * capacity, start + n)
            for name, arr in self.arrays.items():
                grown = np.zeros((new_cap, *arr.shape[1:]), dtype=arr.dtype)
                grown[: self.length] = arr[: self.length]
                self.arrays[name] = grown
        for name, val in values.items():
            self.arrays[name][start : start + n] = val
        self.length = start + n

    def view(self, start: int, stop: int) -> LatentRows:
        a = self.arrays
        if self.kv_dtype == "f32":
            return F32Rows(lc=a["lc"][start:stop], rc=a["rc"][start:stop])
        return Fp8Rows(
            lc_codes=a["lc_codes"][start:stop], lc_scale=a["lc_scale"][start:stop],
            rc_codes=a["rc_codes"][start:stop], rc_scale=a["rc_scale"][start:stop],
        )


class DecoderCache:
    """Latent rows of every layer for positions [0, length), plus the input token of each."""

    def __init__(
        self, n_layers: int, kv_lora: int, qk_rope: int, kv_dtype: str = "f32", backend: str | Any = "cpu"
    ) -> None:
        if kv_dtype not in KV_DTYPES:
            raise FormatError(f"kv dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        self.n_layers, self.kv_lora, self.qk_rope, self.kv_dtype = n_layers, kv_lora, qk_rope, kv_dtype
        self.backend = _resolve_backend(backend)
        self._base: list[list[LatentRows]] = [[] for _ in range(n_layers)]
        self._base_tokens = np.zeros(0, dtype="<i4")  # [base_len] i32
        self._base_len = 0
        self._own = [_GrowableRows(kv_dtype, kv_lora, qk_rope) for _ in range(n_layers)]
        self._own_tokens = np.zeros(_INITIAL_CAPACITY, dtype="<i4")  # [capacity] i32
        self.length = 0

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
    ) -> DecoderCache:
        """A cache over existing rows (kept as given: views are not copied), one block list per layer."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype != np.dtype("<i4"):
            tokens = np.asarray(tokens, dtype="<i4").reshape(-1)
        blocks = [list(layer) for layer in per_layer_blocks]
        first = next((b for layer in blocks for b in layer), None)
        if kv_dtype is None:
            kv_dtype = "fp8" if isinstance(first, Fp8Rows) else "f32"
        if first is not None:
            kv_lora = kv_lora or _width(first, "lc")
            qk_rope = qk_rope or _width(first, "rc")
        if kv_lora is None or qk_rope is None:
            raise FormatError("from_blocks: no rows to infer kv_lora/qk_rope from; pass them explicitly")
        cache = cls(len(blocks), kv_lora, qk_rope, kv_dtype, backend)
        want = Fp8Rows if kv_dtype == "fp8" else F32Rows
        for layer, layer_blocks in enumerate(blocks):
            total = 0
            for b in layer_blocks:
                if not isinstance(b, want):
                    raise ModelMismatchError(
                        f"layer {layer}: {type(b).__name__} block given to a {kv_dtype} cache"
                        " (a cache reads rows only in the dtype it stores)"
                    )
                if _width(b, "lc") != kv_lora or _width(b, "rc") != qk_rope:
                    raise ModelMismatchError(
                        f"layer {layer}: rows of width {_width(b, 'lc')}/{_width(b, 'rc')},"
                        f" expected kv_lora={kv_lora}/qk_rope={qk_rope}"
                    )
                total += b.length
            if total != tokens.shape[0]:
                raise FormatError(f"layer {layer}: {total} rows for {tokens.shape[0]} tokens")
        cache._base = blocks
        cache._base_tokens = tokens
        cache._base_len = cache.length = int(tokens.shape[0])
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
            out.append(b if pos + b.length <= stop else _slice(b, 0, stop - pos))
            pos += b.length
        if stop > self._base_len:
            out.append(own.view(0, stop - self._base_len))
        return out

    @property
    def tokens(self) -> np.ndarray:
        """Input tokens [length] i32 (a copy)."""
        own = self._own_tokens[: self.length - self._base_len]
        return np.concatenate([self._base_tokens[: min(self.length, self._base_len)], own]).astype("<i4")

    def records_since(self, start: int) -> RecordRows:
        """Positions [start, length) across all layers, record-major, as the file stores them."""
        if not 0 <= start <= self.length:
            raise FormatError(f"records_since({start}): the cache holds {self.length} positions")
        tokens = self.tokens[start:]  # [k] i32
        fields: dict[str, np.ndarray] = {}
        if start == self.length:
            empty = _GrowableRows(self.kv_dtype, self.kv_lora, self.qk_rope).arrays
            for name, arr in empty.items():
                fields[name] = np.zeros((0, self.n_layers, *arr.shape[1:]), dtype=arr.dtype)  # [0, L, *]
            return RecordRows(tokens=tokens, **fields)
        for name in _FIELDS[self.kv_dtype]:
            per_layer = [
                np.concatenate([getattr(b, name) for b in _window(self.blocks(layer, self.length), start)])
                for layer in range(self.n_layers)
            ]  # each: [k, *]
            fields[name] = np.ascontiguousarray(np.stack(per_layer, axis=1))  # [k, L, *]
        return RecordRows(tokens=tokens, **fields)

    # ---- writing (the decoder's protocol) -------------------------------------------------
    def write_layer(self, layer: int, lc: np.ndarray, rc: np.ndarray) -> None:
        """Store the rows of the pending positions [length, length + S) of one layer.

        lc [S, kv_lora] f32, rc [S, qk_rope] f32; fp8 caches keep only the quantized form.
        """
        if self.kv_dtype == "fp8":
            from kernels.fp8 import quantize_rows

            lc_codes, lc_scale = quantize_rows(np.ascontiguousarray(lc, dtype=np.float32))  # [S, kv_lora] u8, [S]
            rc_codes, rc_scale = quantize_rows(np.ascontiguousarray(rc, dtype=np.float32))  # [S, rope] u8, [S]
            values = {"lc_codes": lc_codes, "lc_scale": lc_scale, "rc_codes": rc_codes, "rc_scale": rc_scale}
        else:
            values = {"lc": lc, "rc": rc}
        self._own[layer].write(self.length - self._base_len, values)

    def commit_positions(self, tokens: np.ndarray) -> None:
        """Make the pending positions (written in every layer) part of the cache."""
        start = self.length - self._base_len
        n = tokens.shape[0]
        if any(own.length != start + n for own in self._own):
            raise FormatError("commit_positions: not every layer holds the pending rows")
        if start + n > self._own_tokens.shape[0]:
            grown = np.zeros(max(2 * self._own_tokens.shape[0], start + n), dtype="<i4")
            grown[:start] = self._own_tokens[:start]
            self._own_tokens = grown
        self._own_tokens[start : start + n] = tokens
        self.length += n

    def discard_pending(self) -> None:
        """Forget rows written after ``length`` (a forward pass that failed part-way)."""
        for own in self._own:
            own.length = min(own.length, self.length - self._base_len)

    def truncate(self, n: int) -> int:
        """Keep positions [0, n) (clamped to ``length``); returns the new length."""
        if n < 0:
            raise FormatError(f"truncate({n}): a length cannot be negative")
        n = min(n, self.length)
        if n < self._base_len:
            kept: list[list[LatentRows]] = []
            for layer in range(self.n_layers):
                kept.append(self.blocks(layer, n))
            self._base, self._base_len = kept, n
            self._base_tokens = self._base_tokens[:n]
        for own in self._own:
            own.length = n - self._base_len
        self.length = n
        return n

    @property
    def own_nbytes(self) -> int:
        """Bytes of the storage this cache allocated (base blocks not counted)."""
        return sum(arr.nbytes for own in self._own for arr in own.arrays.values())


def _width(b: LatentRows, which: str) -> int:
    if isinstance(b, F32Rows):
        arr = b.lc if which == "lc" else b.rc
    else:
        arr = b.lc_codes if which == "lc" else b.rc_codes
    return int(arr.shape[1])


def _slice(b: LatentRows, start: int, stop: int) -> LatentRows:
    if isinstance(b, F32Rows):
        return F32Rows(lc=b.lc[start:stop], rc=b.rc[start:stop])
    return Fp8Rows(
        lc_codes=b.lc_codes[start:stop], lc_scale=b.lc_scale[start:stop],
        rc_codes=b.rc_codes[start:stop], rc_scale=b.rc_scale[start:stop],
    )


def _window(blocks: list[LatentRows], start: int) -> list[LatentRows]:
    """The blocks cut to positions [start, end)."""
    out: list[LatentRows] = []
    pos = 0
    for b in blocks:
        lo = max(start - pos, 0)
        if lo < b.length:
            out.append(_slice(b, lo, b.length))
        pos += b.length
    return out
