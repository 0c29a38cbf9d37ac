"""DSA row selection for one decode step of B sessions: each session's single query (at its newest
position, which sees every key its cache holds) scored against its own keys and cut to the
engine's top-k, in compiled code (a few calls per session instead of a few dozen numpy calls).

The math and the tie rule are those of :mod:`kernels.attention.selection`:
    score_t = sum_h (w_h * hd ** -0.5) * relu(qi_h . Ic_t)
    threshold = the k-th largest score (NaN counts as -inf); every key above it is taken, then
    keys equal to it in ascending position order until k are taken; returned ascending.
Every score's arithmetic is fixed by construction (each dot product over eight lanes combined
in a fixed tree, the heads summed in order, strict IEEE f32): a session's selection depends on
its own query and keys only, never on the batch. Every forward selects through it (a prompt's
positions too, each as its decode step); it is not bitwise the BLAS products of
:func:`~kernels.attention.selection.index_scores`, whose sums associate as the library chooses.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import njit, types, void

from kernels.attention.lanes import lane_sums
from kernels.compile_notice import announce_if_cold
from kernels.errors import FormatError

_F32 = types.float32


def _score_signatures() -> list[Any]:
    """keys may be strided (a file's [T, NI, hd] rows cut at one slot) and read-only (a mapping)."""
    qi, w, out = types.Array(_F32, 2, "C"), types.Array(_F32, 1, "C"), types.Array(_F32, 1, "C")
    keys = (types.Array(_F32, 2, "C"), types.Array(_F32, 2, "A"), types.Array(_F32, 2, "A", readonly=True))
    return [void(qi, w, k, out) for k in keys]


announce_if_cold(__file__)  # numba compiles the kernels below now unless cached

@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def score_row(qi: np.ndarray, w: np.ndarray, key: np.ndarray) -> np.float32:  # pragma: no cover - compiled
    """sum_h w[h] * relu(qi[h] . key) for qi [nh, hd], w [nh] (scaled), one key [hd]: each dot
    product over eight lanes (one vector's chain, :func:`kernels.attention.lanes.lane_sums`, where the
    key's floats are adjacent; the same sums lane by lane where a view strides them) combined in a
    fixed tree, the heads summed in order."""
    depth = key.shape[0]
    full = depth - depth % 8
    adjacent = key.strides[0] == 4
    total = np.float32(0.0)
    for h in range(qi.shape[0]):
        q = qi[h]
        if adjacent:
            s0, s1, s2, s3, s4, s5, s6, s7 = lane_sums(q.ctypes.data, key.ctypes.data, full)
        else:
            s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
            for i in range(0, full, 8):
                s0 += q[i] * key[i]
                s1 += q[i + 1] * key[i + 1]
                s2 += q[i + 2] * key[i + 2]
                s3 += q[i + 3] * key[i + 3]
                s4 += q[i + 4] * key[i + 4]
                s5 += q[i + 5] * key[i + 5]
                s6 += q[i + 6] * key[i + 6]
                s7 += q[i + 7] * key[i + 7]
        dot = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
        for i in range(full, depth):
            dot += q[i] * key[i]
        relu = np.float32(0.0) if dot <= 0 else dot  # NaN stays NaN, as np.maximum keeps it
        total += w[h] * relu
    return total


@njit(_score_signatures(), cache=True, nogil=True, boundscheck=False)
def _score_keys(qi: np.ndarray, w: np.ndarray, keys: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """out [t] = sum_h w[h] * relu(qi[h] . keys[t]) for qi [nh, hd], w [nh] (scaled), keys [t, hd]."""
    for t in range(keys.shape[0]):
        out[t] = score_row(qi, w, keys[t])


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _sift_down(heap: np.ndarray, v: np.float32) -> None:  # pragma: no cover - compiled
    """Replace the least value of the min-heap ``heap`` [k] f32 by ``v`` and restore the heap."""
    k = heap.shape[0]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= k:
            break
        if c + 1 < k and heap[c + 1] < heap[c]:
            c += 1
        if heap[c] >= v:
            break
        heap[i] = heap[c]
        i = c
    heap[i] = v


@njit(void(types.Array(_F32, 1, "C"), types.Array(types.int64, 1, "C")), cache=True, nogil=True, boundscheck=False)
def engine_topk(scores: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out [k] = the engine's top-k positions of scores [T] (T > k), ascending; NaN scores are
    set to -inf in place first.

    The threshold (the k-th largest score, counted with repeats) is the least of the k largest
    scores, kept in a min-heap as the scores are read: one comparison for most scores, log k moves
    for the few that enter (np.partition copied the row and reselected it). It does not depend on
    the order the scores are read in: newest key first, as an indexer tends to score recent keys
    higher, so the heap fills with large scores early and most later ones are turned away (a
    600-key row: 2.7-9.1 us with np.partition, 1.1-6.2 us so, over random, trending and sorted
    scores). The scores above it are the heap's other members."""
    n, k = scores.shape[0], out.shape[0]
    heap = np.full(k, -np.inf, np.float32)  # heap: [k] f32, a min-heap of the largest scores read
    for t in range(n - 1, -1, -1):
        v = scores[t]
        if np.isnan(v):
            v = scores[t] = np.float32(-np.inf)
        if v > heap[0]:
            _sift_down(heap, v)
    thr = heap[0]  # the k-th largest (T > k: the heap's -inf fillers are all replaced or tie with it)
    above = 0
    for i in range(k):
        if heap[i] > thr:
            above += 1
    ties = k - above
    j = 0
    for t in range(n):
        v = scores[t]
        if v > thr:
            out[j] = t
            j += 1
        elif v == thr and ties > 0:
            out[j] = t
            j += 1
            ties -= 1


def select_step(qi: np.ndarray, weights: np.ndarray, key_blocks_of: Sequence[Sequence[np.ndarray]],
                k: int) -> np.ndarray:
    """Top-k rows of B sessions for their newest positions: qi [B, nh, hd], weights [B, nh],
    session b's keys ``key_blocks_of[b]`` ([t, hd] f32 blocks in position order, the query's own
    key last; more than k in all) -> selection [B, k] i64, ascending positions per row."""
    n, nh, hd = qi.shape
    if weights.shape != (n, nh) or len(key_blocks_of) != n:
        raise FormatError(f"select_step: {n} queries, weights {weights.shape}, {len(key_blocks_of)} sessions")
    q = np.ascontiguousarray(qi, dtype=np.float32)  # q: [B, nh, hd] f32
    w = np.ascontiguousarray(np.asarray(weights, dtype=np.float32) * np.float32(hd**-0.5))  # w: [B, nh] f32
    out = np.empty((n, k), np.int64)  # out: [B, k] i64
    for b, blocks in enumerate(key_blocks_of):
        length = sum(int(blk.shape[0]) for blk in blocks)
        if k < 1 or length <= k:
            raise FormatError(f"select_step: k={k} rows of {length} keys (a query needs more than k)")
        if any(blk.ndim != 2 or blk.shape[1] != hd or blk.dtype != np.float32 for blk in blocks):
            raise FormatError(f"select_step: key blocks must be float32 [t, {hd}]")
        scores = np.empty(length, np.float32)  # scores: [T] f32
        start = 0
        for blk in blocks:
            _score_keys(q[b], w[b], blk, scores[start : start + blk.shape[0]])
            start += blk.shape[0]
        engine_topk(scores, out[b])
    return out


__all__ = ["engine_topk", "score_row", "select_step"]
