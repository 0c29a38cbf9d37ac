"""The per-session work of one batched step, vectorised: every session's rows written, keys
written, rows selected and attended in ONE compiled call per layer (kernels.attention.row_tables),
instead of a Python loop over the sessions in every layer.

Built once per step from its rows (:func:`kernels.model.step_rows.step_rows_of`) when every cache is
fp8 on the CPU backend (the serving case); otherwise the decoder keeps its session-by-session
path (the compiled step, :mod:`kernels.model.compiled_step`, also takes the tables of f32 and v3 caches).
Building reserves each cache's room for its new positions first, so no array moves while
the step's kernels hold their addresses; each cache's own tables are kept by the cache and
rebuilt only when its storage moves (so a step builds the batch's tables from a few stacked
arrays, not from every session's blocks).

Bitwise: the new rows are encoded by the same ``quantize_rows`` call over the batch, and the
kernels share the session-by-session kernels' arithmetic (see kernels.attention.row_tables).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kernels.attention.row_tables import attend_rows, select_rows, write_fp8_rows, write_keys
from kernels.backend import CpuBackend
from kernels.fp8 import quantize_rows
from kernels.fp8.tables import DECODE_TABLE
from kernels.model.cache import DecoderCache
from kernels.model.row_addresses import RowTables
from kernels.model.step_rows import StepPosition, StepRow


class StepTables:
    """One step's rows (every cache of one ``kv_dtype``) as address tables: ``latent`` [L, B, NB, 10],
    ``index`` [NI, B, NBi, 4],
    the destinations of each row's new latent row ``dst`` [L, B, 4] and key ``key_dst`` [NI, B],
    and ``visible`` [B] (the positions each row's query sees: its own and every one before)."""

    def __init__(self, rows: Sequence[StepRow], caches: list[tuple[DecoderCache, int]],
                 latent: np.ndarray, index: np.ndarray, dst: np.ndarray, key_dst: np.ndarray,
                 visible: np.ndarray, kv_dtype: str = "fp8") -> None:
        self.rows, self.caches, self.kv_dtype = rows, caches, kv_dtype
        self.latent, self.index, self.dst, self.key_dst, self.visible = latent, index, dst, key_dst, visible

    @classmethod
    def of(cls, rows: Sequence[StepRow], kinds: tuple[str, ...] = ("fp8",)) -> StepTables | None:
        """The tables of a step's rows, or None unless every cache is on the CPU backend, of one
        kv dtype, of a row kind among ``kinds`` ("fp8": the reference step's batch kernels below;
        the compiled step also takes "f32" and "tq", the v3 caches)."""
        by_id: dict[int, DecoderCache] = {}  # the step's caches, in order of first row
        counts: dict[int, int] = {}  # id(cache) -> its rows in this step
        kv_dtype = ""
        for row in rows:
            cache = row.cache if isinstance(row, StepPosition) else row
            if not isinstance(cache, DecoderCache) or cache.kind not in kinds or not isinstance(cache.backend,
                                                                                               CpuBackend):
                return None
            if kv_dtype and cache.kv_dtype != kv_dtype:
                return None
            kv_dtype = cache.kv_dtype
            by_id.setdefault(id(cache), cache)
            counts[id(cache)] = counts.get(id(cache), 0) + 1
        per_cache = [(cache, counts[key]) for key, cache in by_id.items()]
        for cache, n in per_cache:
            cache.reserve(n)
        tables = {id(c): c.row_tables() for c, _ in per_cache}
        row_tables = [tables[id(row.cache if isinstance(row, StepPosition) else row)] for row in rows]
        if any(t is None for t in row_tables):
            return None
        ts: list[RowTables] = row_tables  # type: ignore[assignment]  # (no None: checked above)
        positions = np.fromiter((row.length for row in rows), np.int64, len(rows))  # [B] each row's position
        if len(per_cache) == 1:  # one cache's rows (a lone stream's step, a lone prompt): nothing to stack
            return cls._of_one(rows, per_cache, ts[0], positions, kv_dtype)
        owned = positions - np.fromiter((t.base_len for t in ts), np.int64, len(ts))  # [B] its owned row index
        own_latent = np.stack([t.own_latent for t in ts])  # [B, L, 4, 2] i64 (row 0 address, row stride)
        own_index = np.stack([t.own_index for t in ts])  # [B, NI, 2] i64
        dst = own_latent[..., 0] + owned[:, None, None] * own_latent[..., 1]  # [B, L, 4] i64 addresses
        key_dst = own_index[..., 0] + owned[:, None] * own_index[..., 1]  # [B, NI] i64 addresses
        return cls(rows, per_cache, _stacked([t.latent for t in ts]), _stacked([t.index for t in ts]),
                   np.ascontiguousarray(dst.transpose(1, 0, 2)), np.ascontiguousarray(key_dst.T), positions + 1,
                   kv_dtype)

    @classmethod
    def _of_one(cls, rows: Sequence[StepRow], caches: list[tuple[DecoderCache, int]], t: RowTables,
                positions: np.ndarray, kv_dtype: str) -> StepTables:
        """The tables of B rows of one cache (positions [B] i64): the same arrays :meth:`of` stacks
        from B copies of its tables, each built in one operation."""
        owned = positions - t.base_len  # [B] each row's owned row index
        b = positions.shape[0]
        dst = t.own_latent[None, :, :, 0] + owned[:, None, None] * t.own_latent[None, :, :, 1]  # [B, L, 4] i64
        key_dst = t.own_index[None, :, 0] + owned[:, None] * t.own_index[None, :, 1]  # [B, NI] i64
        latent = np.repeat(t.latent[:, None], b, axis=1) if b > 1 else t.latent[:, None]  # [L, B, NB, F] i64
        index = np.repeat(t.index[:, None], b, axis=1) if b > 1 else t.index[:, None]  # [NI, B, NBi, 4] i64
        return cls(rows, caches, latent, index, np.ascontiguousarray(dst.transpose(1, 0, 2)),
                   np.ascontiguousarray(key_dst.T), positions + 1, kv_dtype)

    def write_rows(self, layer: int, lc: np.ndarray, rc: np.ndarray) -> None:
        """Row b of lc [B, kv_lora], rc [B, rope] f32, fp8-encoded (each row alone), to row b's
        pending position of ``layer``."""
        lc_codes, lc_scale = quantize_rows(np.ascontiguousarray(lc, dtype=np.float32))  # [B, kv_lora] u8, [B] f32
        rc_codes, rc_scale = quantize_rows(np.ascontiguousarray(rc, dtype=np.float32))  # [B, rope] u8, [B] f32
        write_fp8_rows(self.dst[layer], lc_codes, lc_scale, rc_codes, rc_scale)
        for cache, n in self.caches:
            cache.mark_written(n, layer=layer)

    def write_keys(self, slot: int, keys: np.ndarray) -> None:
        """Row b of keys [B, hd] f32 as row b's indexer key in full layer number ``slot``."""
        write_keys(self.key_dst[slot], np.ascontiguousarray(keys, dtype=np.float32))
        for cache, n in self.caches:
            cache.mark_written(n, slot=slot)

    def mark_all_written(self) -> None:
        """Every layer's rows and every full layer's keys of the step were written (the compiled
        step writes them all in one call)."""
        for cache, n in self.caches:
            cache.mark_step_written(n)

    def any_past(self, k: int) -> bool:
        """Whether some row's query sees more than ``k`` positions (so selection must score)."""
        return bool(self.visible.max() > k)

    def select(self, slot: int, qi: np.ndarray, weights: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's rows to attend with full layer ``slot``'s keys: the engine's top-k where it
        sees more than k, else all it sees. qi [B, nh, hd], weights [B, nh] f32 ->
        (selection [B, k] i64 ascending, counts [B] i64)."""
        hd = qi.shape[2]
        q = np.ascontiguousarray(qi, dtype=np.float32)  # q: [B, nh, hd] f32
        w = np.ascontiguousarray(np.asarray(weights, dtype=np.float32) * np.float32(hd**-0.5))  # w: [B, nh] f32
        sel = np.empty((q.shape[0], k), np.int64)  # sel: [B, k] i64
        counts = np.empty(q.shape[0], np.int64)  # counts: [B] i64
        select_rows(q, w, self.index[slot], self.visible, sel, counts)
        return sel, counts

    def attend(self, layer: int, q_abs: np.ndarray, q_rope: np.ndarray, sel: np.ndarray, counts: np.ndarray,
               softmax_scale: float) -> np.ndarray:
        """Row b's queries q_abs [B, H, kv_lora], q_rope [B, H, rope] over its rows sel[b, :counts[b]]
        of ``layer`` -> ctx [B, H, kv_lora] f32."""
        ctx = np.empty(q_abs.shape, np.float32)  # ctx: [B, H, kv_lora] f32
        attend_rows(np.ascontiguousarray(q_abs, dtype=np.float32), np.ascontiguousarray(q_rope, dtype=np.float32),
                    self.latent[layer], sel, counts, DECODE_TABLE, np.float32(softmax_scale), ctx)
        return ctx


def _stacked(tables: list[np.ndarray]) -> np.ndarray:
    """Each row's [n, NB_b, F] table -> [n, B, max NB, F] i64 (narrower ones padded with empty blocks)."""
    widest = max(t.shape[1] for t in tables)
    if all(t.shape[1] == widest for t in tables):
        return np.stack(tables, axis=1)  # the usual step: every cache's tables alike in shape
    out = np.zeros((tables[0].shape[0], len(tables), widest, tables[0].shape[2]), np.int64)  # [n, B, NB, F]
    for b, t in enumerate(tables):
        out[:, b, : t.shape[1]] = t
    return out


__all__ = ["StepTables"]
