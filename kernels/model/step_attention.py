"""The reference step's attention of every row of a batched step, DeepSeek-V3's and GLM-5's alike.

Each row's query attends the rows its session holds up to its own position: all of them (a
DeepSeek-V3 layer, or a GLM-5 row that does not yet see more than ``index_topk`` rows), or those
a DSA selection picked. Every path is batch-invariant, so a row's context is bitwise what its
token alone gets, whoever shares the step:
- a step with address tables (every cache fp8 on the CPU): one call per layer
  (:meth:`kernels.model.step_tables.StepTables.attend`, :func:`all_visible` for dense rows);
- a backend with ``batched_sparse_decode`` (the CPU one, for f32, v3 or mixed caches): one call per
  row count, dense rows as the selection of every row they see;
- any other backend (CUDA): session by session, ``absorbed_attention`` or
  ``sparse_absorbed_attention``.
The compiled step (:mod:`kernels.model.compiled_step`) calls the same kernels as the first two.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels.attention.tiles import cache_shape
from kernels.errors import BackendUnavailableError
from kernels.model.step_rows import StepRow


def all_visible(visible: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every row each query sees: ``visible`` [B] (positions [0, visible[b])) -> (selection [B, max
    visible] i64, row b's first visible[b] entries 0, 1, ..; counts [B] i64)."""
    width = int(visible.max()) if visible.shape[0] else 0
    sel = np.empty((visible.shape[0], width), np.int64)  # sel: [B, T] i64
    sel[:] = np.arange(width, dtype=np.int64)
    return sel, np.ascontiguousarray(visible, dtype=np.int64)


def attend_rows_of(layer: int, q_abs: np.ndarray, q_rope: np.ndarray, caches: Sequence[StepRow],
                   selections: dict[int, np.ndarray], softmax_scale: float, step: dict[str, Any]) -> np.ndarray:
    """Row b's queries q_abs [B, H, kv_lora], q_rope [B, H, rope] over its cache's rows of ``layer``:
    those of ``selections[b]`` [1, k] i64 where it has one, else every row up to its position.
    Rows of a backend that batches the step attend in one call per row count; others row by row.
    ``step`` keeps what every layer of the step shares (the caches' shapes) -> ctx [B, H, kv_lora] f32."""
    ctx = np.empty(q_abs.shape, np.float32)  # ctx: [B, H, kv_lora] f32
    groups: dict[tuple[int, type], list[int]] = {}  # (rows attended, backend) -> the batch rows
    for b, cache in enumerate(caches):
        if hasattr(cache.backend, "batched_sparse_decode"):
            k = selections[b].shape[1] if b in selections else cache.length + 1
            groups.setdefault((k, type(cache.backend)), []).append(b)
        elif b in selections:
            ctx[b : b + 1] = _sparse_of(cache.backend)(q_abs[b : b + 1], q_rope[b : b + 1], cache.blocks(layer),
                                                       selections[b], softmax_scale)
        else:
            ctx[b : b + 1] = cache.backend.absorbed_attention(q_abs[b : b + 1], q_rope[b : b + 1],
                                                              cache.blocks(layer), softmax_scale, causal=True)
    shapes: dict[tuple[int, ...], list[Any]] = step.setdefault("shapes", {})
    for (k, _), members in groups.items():
        rows = np.asarray(members)  # rows: [n] batch rows
        blocks_of = [caches[b].blocks(layer) for b in members]
        key = tuple(members)
        if key not in shapes:  # every layer of a cache holds as many rows: described once a step
            shapes[key] = [cache_shape(blocks) for blocks in blocks_of]
        picks = [selections[b][0] if b in selections else np.arange(k) for b in members]  # [k] i64 each
        ctx[rows] = caches[members[0]].backend.batched_sparse_decode(
            q_abs[rows], q_rope[rows], blocks_of, picks, softmax_scale, shapes=shapes[key])
    return ctx


def _sparse_of(backend: Any) -> Any:
    sparse = getattr(backend, "sparse_absorbed_attention", None)
    if sparse is None:
        name = getattr(backend, "name", type(backend).__name__)
        raise BackendUnavailableError(f"the {name!r} backend has no sparse_absorbed_attention (DSA)")
    return sparse


__all__ = ["all_visible", "attend_rows_of"]
