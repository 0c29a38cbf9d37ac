"""The decoder cache's own storage: the rows a cache grows after its base blocks (latent rows in
the cache's encoding; a DSA model's f32 indexer keys), and the helpers that cut blocks of rows
into views (no copy). :mod:`kernels.model.cache` builds :class:`DecoderCache` on them."""
from __future__ import annotations

import dataclasses

import numpy as np

from kernels.errors import FormatError, ModelMismatchError
from kernels.rows import KV_DTYPES, KV_VERSION_OF_DTYPE, F32Rows, Fp8Rows, LatentRows, TqRows
from kernels.tq import TqCodec

# the arrays a layer's rows live in, by row kind; v3 radii are RecordRows' lc_scale / rc_scale
FIELDS = {"f32": ("lc", "rc"), "fp8": ("lc_codes", "lc_scale", "rc_codes", "rc_scale"),
           "tq": ("lc_codes", "lc_radius", "rc_codes", "rc_radius")}
RECORD_FIELD = {"lc_radius": "lc_scale", "rc_radius": "rc_scale"}
INITIAL_CAPACITY = 64


def row_kind(kv_dtype: str) -> str:
    """"f32", "fp8" or "tq" (the 4-bit tier) for a kv dtype name."""
    if kv_dtype not in KV_DTYPES:
        raise FormatError(f"kv dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return "tq" if KV_VERSION_OF_DTYPE[kv_dtype] == 3 else kv_dtype


class Moves:
    """How many times a cache's owned arrays were reallocated (its address tables go stale)."""

    def __init__(self) -> None:
        self.count = 0


class GrowableRows:
    """One layer's owned rows: arrays with spare capacity, doubled when full."""

    def __init__(self, kv_dtype: str, kv_lora: int, rope: int, moves: Moves | None = None) -> None:
        self.kind = row_kind(kv_dtype)
        self.codec = TqCodec.from_kv_dtype(kv_dtype) if self.kind == "tq" else None
        self.kv_lora, self.rope = kv_lora, rope
        self.length = 0
        self.moves = moves or Moves()  # the cache's count of reallocations
        code_widths = (kv_lora, rope) if self.codec is None else (self.codec.row_bytes(kv_lora),
                                                                  self.codec.row_bytes(rope))
        shapes = {"lc": (kv_lora,), "rc": (rope,), "lc_codes": (code_widths[0],), "rc_codes": (code_widths[1],),
                  "lc_scale": (), "rc_scale": (), "lc_radius": (), "rc_radius": ()}
        self.arrays = {
            name: np.zeros((INITIAL_CAPACITY, *shapes[name]), dtype=np.uint8 if name.endswith("codes") else np.float32)
            for name in FIELDS[self.kind]
        }  # each: [capacity, *] (f32 rows, u8 codes or f32 scales / radii)

    def write(self, start: int, values: dict[str, np.ndarray]) -> None:
        """Write rows at owned positions [start, start + n) (n = rows in values)."""
        n = next(iter(values.values())).shape[0]
        capacity = next(iter(self.arrays.values())).shape[0]
        if start + n > capacity:
            self.reserve(start + n)
        for name, val in values.items():
            self.arrays[name][start : start + n] = val
        self.length = start + n

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` owned rows (capacity doubled, or more, when short); keeps the rows held."""
        capacity = next(iter(self.arrays.values())).shape[0]
        if rows <= capacity:
            return
        new_cap = max(2 * capacity, rows)
        for name, arr in self.arrays.items():
            grown = np.zeros((new_cap, *arr.shape[1:]), dtype=arr.dtype)
            grown[: self.length] = arr[: self.length]
            self.arrays[name] = grown
        self.moves.count += 1

    def write_row(self, pos: int, values: dict[str, np.ndarray], i: int) -> None:
        """Row i of every batch array in ``values`` ({field: [B, *]}) at owned position ``pos``
        (a decode step's one new row: no per-row dict or slices)."""
        if pos >= next(iter(self.arrays.values())).shape[0]:
            self.write(pos, {name: val[i : i + 1] for name, val in values.items()})
            return
        for name, arr in self.arrays.items():
            arr[pos] = values[name][i]
        self.length = pos + 1

    def view(self, start: int, stop: int) -> LatentRows:
        a = self.arrays
        if self.kind == "f32":
            return F32Rows(lc=a["lc"][start:stop], rc=a["rc"][start:stop])
        if self.codec is not None:
            return TqRows(lc_codes=a["lc_codes"][start:stop], lc_radius=a["lc_radius"][start:stop],
                          rc_codes=a["rc_codes"][start:stop], rc_radius=a["rc_radius"][start:stop],
                          codec=self.codec, kv_lora=self.kv_lora, qk_rope=self.rope)
        return Fp8Rows(
            lc_codes=a["lc_codes"][start:stop], lc_scale=a["lc_scale"][start:stop],
            rc_codes=a["rc_codes"][start:stop], rc_scale=a["rc_scale"][start:stop],
        )


class GrowableIndex:
    """One full layer's owned indexer keys: [capacity, hd] f32, doubled when full."""

    def __init__(self, head_dim: int, moves: Moves | None = None) -> None:
        self.length = 0
        self.moves = moves or Moves()  # the cache's count of reallocations
        self.rows = np.zeros((INITIAL_CAPACITY, head_dim), dtype=np.float32)  # rows: [capacity, hd] f32

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` owned keys; keeps the keys held."""
        if rows <= self.rows.shape[0]:
            return
        grown = np.zeros((max(2 * self.rows.shape[0], rows), self.rows.shape[1]), dtype=np.float32)
        grown[: self.length] = self.rows[: self.length]
        self.rows = grown
        self.moves.count += 1

    def write(self, start: int, ic: np.ndarray) -> None:
        n = ic.shape[0]
        self.reserve(start + n)
        self.rows[start : start + n] = ic
        self.length = start + n

    def write_row(self, pos: int, keys: np.ndarray, i: int) -> None:
        """Row i of keys [B, hd] f32 at owned position ``pos``."""
        if pos >= self.rows.shape[0]:
            self.write(pos, keys[i : i + 1])
            return
        self.rows[pos] = keys[i]
        self.length = pos + 1


def row_width(b: LatentRows, which: str) -> int:
    """The row width (kv_lora or qk_rope) of a block's Lc or Rc rows."""
    if isinstance(b, TqRows):
        return b.kv_lora if which == "lc" else b.qk_rope
    if isinstance(b, F32Rows):
        arr = b.lc if which == "lc" else b.rc
    else:
        arr = b.lc_codes if which == "lc" else b.rc_codes
    return int(arr.shape[1])


def slice_rows(b: LatentRows, start: int, stop: int) -> LatentRows:
    if isinstance(b, F32Rows):
        return F32Rows(lc=b.lc[start:stop], rc=b.rc[start:stop])
    if isinstance(b, TqRows):
        return dataclasses.replace(b, lc_codes=b.lc_codes[start:stop], lc_radius=b.lc_radius[start:stop],
                                   rc_codes=b.rc_codes[start:stop], rc_radius=b.rc_radius[start:stop])
    return Fp8Rows(
        lc_codes=b.lc_codes[start:stop], lc_scale=b.lc_scale[start:stop],
        rc_codes=b.rc_codes[start:stop], rc_scale=b.rc_scale[start:stop],
    )


def window_from(blocks: list[LatentRows], start: int) -> list[LatentRows]:
    """The blocks cut to positions [start, end)."""
    out: list[LatentRows] = []
    pos = 0
    for b in blocks:
        lo = max(start - pos, 0)
        if lo < b.length:
            out.append(slice_rows(b, lo, b.length))
        pos += b.length
    return out


def check_index_rows(rows: np.ndarray | None, length: int, n_index: int, head_dim: int) -> np.ndarray:
    """The resumed indexer keys as given (not copied), checked: [T, NI, hd] f32."""
    want = (length, n_index, head_dim)
    if rows is None:
        if n_index and length:
            raise ModelMismatchError(f"from_blocks: {length} positions of a model with {n_index} indexer layers"
                                     " need their indexer rows (index_rows [T, NI, hd])")
        return np.zeros(want, np.float32)
    if not isinstance(rows, np.ndarray) or rows.dtype != np.float32 or rows.shape != want:
        found = f"{rows.dtype} {rows.shape}" if isinstance(rows, np.ndarray) else type(rows).__name__
        raise ModelMismatchError(f"from_blocks: index_rows must be float32 {want}, found {found}")
    return rows


__all__ = ["FIELDS", "INITIAL_CAPACITY", "RECORD_FIELD", "GrowableIndex", "GrowableRows", "Moves", "check_index_rows",
           "row_kind", "row_width", "slice_rows", "window_from"]
