"""The per-session work of one batched step, vectorised: every session's rows written, keys
written, rows selected and attended in ONE compiled call per layer (kernels.attention.row_tables),
instead of a Python loop over the sessions in every layer.

Built once per step from its caches and their new positions when every cache is
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


class StepTables:
    """One step's rows (every cache of one ``kv_dtype``) as address tables: ``latent`` [L, B, NB, 10],
    ``index`` [NI, B, NBi, 4],
    the destinations of each row's new latent row ``dst`` [L, B, 4] and key ``key_dst`` [NI, B],
    and ``visible`` [B] (the positions each row's query sees: its own and every one before)."""

    def __init__(self, caches: list[tuple[DecoderCache, int]], latent: np.ndarray, index: np.ndarray, dst: np.ndarray,
                 key_dst: np.ndarray, visible: np.ndarray, kv_dtype: str = "fp8") -> None:
        self.caches, self.kv_dtype = caches, kv_dtype
        self.latent, self.index, self.dst, self.key_dst, self.visible = latent, index, dst, key_dst, visible

    @classmethod
    def of(cls, caches: Sequence[DecoderCache], counts: Sequence[int],
           kinds: tuple[str, ...] = ("fp8",)) -> StepTables | None:
        """The tables of a step in which cache b takes ``counts[b]`` new positions (its rows in order,
        as :func:`kernels.model.step_rows.step_rows_of` lists them), or None unless every cache is on
        the CPU backend, of one kv dtype, of a row kind among ``kinds`` ("fp8": the reference step's
        batch kernels below; the compiled step also takes "f32" and "tq", the v3 caches).

        Built per cache, not per row: a prompt chunk's rows are its cache's tables repeated, each row
        seeing one more position (no Python loop over a chunk's rows)."""
        kv_dtype = ""
        for cache in caches:
            if not isinstance(cache, DecoderCache) or cache.kind not in kinds or not isinstance(cache.backend,
                                                                                               CpuBackend):
                return None
            if kv_dtype and cache.kv_dtype != kv_dtype:
                return None
            kv_dtype = cache.kv_dtype
        for cache, n in zip(caches, counts, strict=True):
            cache.reserve(n)
        ts = [cache.row_tables() for cache in caches]
        if any(t is None for t in ts):
            return None
        tables: list[RowTables] = ts  # type: ignore[assignment]  # (no None: checked above)
        pairs = list(zip(caches, counts, strict=True))
        if len(caches) == 1:  # a lone stream's step, a lone prompt: nothing to stack
            return cls._of_one(pairs, tables[0], kv_dtype)
        firsts = np.fromiter((c.length for c in caches), np.int64, len(caches))  # [C] each one's first new position
        bases = np.fromiter((t.base_len for t in tables), np.int64, len(tables))  # [C] each one's owned row 0
        own_latent = np.stack([t.own_latent for t in tables])  # [C, L, 4, 2] i64 (row 0 address, row stride)
        own_index = np.stack([t.own_index for t in tables])  # [C, NI, 2] i64
        latent, index = _stacked([t.latent for t in tables]), _stacked([t.index for t in tables])  # [L|NI, C, NB, F]
        if max(counts) == 1:  # a decode step: a row a cache
            positions = firsts  # [B] each row's position
        else:  # prompt chunks among them: each cache's tables repeated over its rows
            per = np.asarray(counts, np.int64)  # [C] each cache's rows
            offsets = np.arange(int(per.sum()), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)  # [N]
            positions = np.repeat(firsts, per) + offsets  # [N] each row's position
            bases, own_latent, own_index = (np.repeat(a, per, axis=0) for a in (bases, own_latent, own_index))
            latent, index = np.repeat(latent, per, axis=1), np.repeat(index, per, axis=1)  # [L|NI, N, NB, F]
        owned = positions - bases  # [N] each row's owned row index
        dst = own_latent[..., 0] + owned[:, None, None] * own_latent[..., 1]  # [N, L, 4] i64 addresses
        key_dst = own_index[..., 0] + owned[:, None] * own_index[..., 1]  # [N, NI] i64 addresses
        return cls(pairs, latent, index, np.ascontiguousarray(dst.transpose(1, 0, 2)), np.ascontiguousarray(key_dst.T),
                   positions + 1, kv_dtype)

    @classmethod
    def _of_one(cls, pairs: list[tuple[DecoderCache, int]], t: RowTables, kv_dtype: str) -> StepTables:
        """The tables of one cache's n new rows: its tables, repeated n times, each built in one operation."""
        cache, n = pairs[0]
        positions = np.arange(cache.length, cache.length + n, dtype=np.int64)  # [n] each row's position
        owned = positions - t.base_len  # [n] each row's owned row index
        dst = t.own_latent[None, :, :, 0] + owned[:, None, None] * t.own_latent[None, :, :, 1]  # [n, L, 4] i64
        key_dst = t.own_index[None, :, 0] + owned[:, None] * t.own_index[None, :, 1]  # [n, NI] i64
        latent = np.repeat(t.latent[:, None], n, axis=1) if n > 1 else t.latent[:, None]  # [L, n, NB, F] i64
        index = np.repeat(t.index[:, None], n, axis=1) if n > 1 else t.index[:, None]  # [NI, n, NBi, 4] i64
        return cls(pairs, latent, index, np.ascontiguousarray(dst.transpose(1, 0, 2)),
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
    """Each cache's [n, NB_c, F] table -> [n, C, max NB, F] i64 (narrower ones padded with empty blocks)."""
    widest = max(t.shape[1] for t in tables)
    if all(t.shape[1] == widest for t in tables):
        return np.stack(tables, axis=1)  # the usual step: every cache's tables alike in shape
    out = np.zeros((tables[0].shape[0], len(tables), widest, tables[0].shape[2]), np.int64)  # [n, B, NB, F]
    for b, t in enumerate(tables):
        out[:, b, : t.shape[1]] = t
    return out


__all__ = ["StepTables"]
