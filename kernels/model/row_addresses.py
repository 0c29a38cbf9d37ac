"""Address tables of a cache's fp8, f32 or v3 rows and indexer keys, the form the batch kernels of
:mod:`kernels.attention.row_tables` (fp8), :mod:`kernels.model.f32_row_tables` (f32) and
:mod:`kernels.model.tq_row_tables` (v3: codes and radii where fp8 keeps codes and scales) read
them in (those modules state the table layouts).

A table holds raw byte addresses: it is valid while the arrays it names live and are not
reallocated. :class:`kernels.model.cache.DecoderCache` builds its own once and rebuilds them when
its storage grows or it is cut back; nothing else should keep one.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.attention.row_tables import INDEX_FIELDS, LATENT_FIELDS
from kernels.rows import F32Rows, Fp8Rows, LatentRows, TqRows
from kernels.tq import TqCodec


def address(arr: np.ndarray) -> int:
    """The byte address of arr's first element."""
    return int(arr.__array_interface__["data"][0])


def latent_table(blocks: Sequence[LatentRows]) -> np.ndarray | None:
    """[NB, LATENT_FIELDS] i64 for ``blocks`` in position order, all fp8, all v3 (codes and radii
    in the fp8 fields) or all f32 (f32 rows in the code fields, no scales: address 0); None when
    the blocks mix kinds or their rows are not contiguous (those take the session-by-session path)."""
    out = np.zeros((len(blocks), LATENT_FIELDS), np.int64)  # out: [NB, 10] i64
    start = 0
    f32 = bool(blocks) and isinstance(blocks[0], F32Rows)
    for i, blk in enumerate(blocks):
        fields: tuple[np.ndarray | None, ...]
        item: type[np.generic]
        if f32 and isinstance(blk, F32Rows):
            fields, item, step = (blk.lc, None, blk.rc, None), np.float32, 4
        elif not f32 and isinstance(blk, Fp8Rows) and isinstance(blocks[0], Fp8Rows):
            fields, item, step = (blk.lc_codes, blk.lc_scale, blk.rc_codes, blk.rc_scale), np.uint8, 1
        elif isinstance(blk, TqRows) and isinstance(blocks[0], TqRows) and blk.codec == blocks[0].codec:
            fields, item, step = (blk.lc_codes, blk.lc_radius, blk.rc_codes, blk.rc_radius), np.uint8, 1
        else:
            return None
        rows = [f for f in fields[::2] if f is not None]
        if any(f.ndim != 2 or f.strides[1] != step or f.dtype != item for f in rows):
            return None
        if any(f is not None and (f.ndim != 1 or f.dtype != np.float32) for f in fields[1::2]):
            return None
        out[i, :2] = start, blk.length
        for j, field in enumerate(fields):
            if field is not None:
                out[i, 2 + 2 * j : 4 + 2 * j] = address(field), field.strides[0]
        start += blk.length
    return out


def index_table(blocks: Sequence[np.ndarray]) -> np.ndarray | None:
    """[NB, INDEX_FIELDS] i64 for indexer-key blocks [t, hd] f32 in position order; None when a
    block's rows are not contiguous f32."""
    out = np.zeros((len(blocks), INDEX_FIELDS), np.int64)  # out: [NB, 4] i64
    start = 0
    for i, rows in enumerate(blocks):
        if rows.ndim != 2 or rows.dtype != np.float32 or rows.strides[1] != 4:
            return None
        out[i] = start, rows.shape[0], address(rows), rows.strides[0]
        start += rows.shape[0]
    return out


def row_origin(arr: np.ndarray) -> tuple[int, int]:
    """(address of row 0, row stride) of an owned array [capacity, ...]."""
    return address(arr), int(arr.strides[0])


_OWN_FIELDS = {"fp8": ("lc_codes", "lc_scale", "rc_codes", "rc_scale"), "f32": ("lc", "", "rc", ""),
               "tq": ("lc_codes", "lc_radius", "rc_codes", "rc_radius")}


@dataclass(frozen=True)
class RowTables:
    """One fp8, f32 or v3 cache's address tables: every layer's blocks (the resumed ones, then the owned
    rows over their whole capacity) and every full layer's key blocks, plus where the owned
    row of a position lies."""

    latent: np.ndarray  # [L, NB, LATENT_FIELDS] i64, padded with empty blocks after the owned one
    index: np.ndarray  # [NI, NBi, INDEX_FIELDS] i64, padded likewise
    own_latent: np.ndarray  # [L, 4, 2] i64: (row 0 address, row stride) of lc codes, lc scale, rc codes, rc scale
    # (f32: of lc, -, rc, -, the scales' (0, 0); v3: the radii where the scales are)
    own_index: np.ndarray  # [NI, 2] i64: (row 0 address, row stride) of the owned keys
    base_len: int  # the position of owned row 0

    @classmethod
    def of(cls, cache: Any) -> RowTables | None:
        """The tables of a :class:`~kernels.model.cache.DecoderCache` as its storage is now; None
        when some rows cannot be described (rows not contiguous)."""
        arrays, keys, base_len = cache.owned_storage()
        if cache.kind not in _OWN_FIELDS:
            return None
        names = _OWN_FIELDS[cache.kind]
        latent = []
        for layer, own in enumerate(arrays):
            resumed = cache.blocks(layer, base_len) if base_len else []
            owned = _owned_rows(cache, own)
            table = latent_table([*resumed, owned])
            if table is None:
                return None
            latent.append(table)
        index = []
        for slot, own_keys in enumerate(keys):
            table = index_table([*(cache.index_blocks(slot, base_len) if base_len else []), own_keys])
            if table is None:
                return None
            index.append(table)
        return cls(latent=_padded(latent, LATENT_FIELDS), index=_padded(index, INDEX_FIELDS),
                   own_latent=np.array([[row_origin(own[f]) if f else (0, 0) for f in names] for own in arrays],
                                       np.int64).reshape(len(arrays), 4, 2),
                   own_index=np.array([row_origin(k) for k in keys], np.int64).reshape(len(keys), 2),
                   base_len=base_len)


def _owned_rows(cache: Any, own: dict[str, np.ndarray]) -> LatentRows:
    """A cache's owned arrays of one layer ({field: [capacity, *]}) as one block over their capacity."""
    if cache.kind == "f32":
        return F32Rows(lc=own["lc"], rc=own["rc"])
    if cache.kind == "tq":
        codec = TqCodec.from_kv_dtype(cache.kv_dtype)
        return TqRows(lc_codes=own["lc_codes"], lc_radius=own["lc_radius"], rc_codes=own["rc_codes"],
                      rc_radius=own["rc_radius"], codec=codec, kv_lora=cache.kv_lora, qk_rope=cache.qk_rope)
    return Fp8Rows(lc_codes=own["lc_codes"], lc_scale=own["lc_scale"], rc_codes=own["rc_codes"],
                   rc_scale=own["rc_scale"])


def _padded(tables: list[np.ndarray], fields: int) -> np.ndarray:
    """[n, NB_i, fields] tables -> [n, max NB, fields] i64, empty blocks after each one's own."""
    widest = max((t.shape[0] for t in tables), default=0)
    out = np.zeros((len(tables), widest, fields), np.int64)  # out: [n, NB, fields] i64
    for i, t in enumerate(tables):
        out[i, : t.shape[0]] = t
    return out


__all__ = ["RowTables", "address", "index_table", "latent_table", "row_origin"]
