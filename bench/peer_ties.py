"""Where llama.cpp's greedy tokens part from ours on glm-mini: the DSA top-k's tie rule (issue 36 part 1).

The indexer scores key t as ``sum_h w_h * relu(q_h . k_t)`` (kernels.attention.selection): a key that every
head scores below zero scores exactly 0. When fewer than ``index_topk`` keys score above zero, which of the
zero-score keys fill the selection is the top-k's tie rule, not arithmetic. Ours is the colibri engine's
(:func:`kernels.attention.selection.engine_topk`: ties go to the lower positions). llama.cpp's CPU top-k
(``ggml_compute_forward_top_k_f32`` in ggml-cpu's ops.cpp) is libstdc++'s ``std::partial_sort`` over the
positions with ``score[a] > score[b]``: a heap, which keeps whichever tied keys its sift order leaves.

:func:`greedy_with_heap_ties` decodes with that rule in place of ours (the numpy reference decoder, f32
cache, in process), so ``bench.peer`` can say how many of its greedy prompts agree with llama.cpp once the tie
rule is the same. A diagnosis only: the served path keeps the engine's rule (tokens equal to the colibri
engine's and transformers').
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np

from kernels.attention.selection import engine_topk, index_scores
from kernels.model import load_model
from kernels.model.generate import generate

Less = Callable[[int, int], bool]


def heap_topk(scores: np.ndarray, k: int) -> np.ndarray:
    """The positions [k] i64 (ascending) that libstdc++'s ``std::partial_sort(first, first + k, last, comp)``
    leaves in its first k places for positions 0..n-1 with ``comp(a, b) = scores[a] > scores[b]``: a heap of
    the first k built in place (``make_heap``), then each later position that beats the heap's top replaces
    it (``__heap_select``); the final sort of the k only orders them. scores [n] f32, k <= n."""
    n = int(scores.shape[0])
    if not 1 <= k <= n:
        raise ValueError(f"heap_topk: k={k} of {n} scores")
    vals = scores.tolist()
    a = list(range(n))

    def comp(x: int, y: int) -> bool:
        return bool(vals[x] > vals[y])

    for parent in range((k - 2) // 2, -1, -1):  # make_heap over a[0:k]
        _adjust(a, parent, k, a[parent], comp)
    for i in range(k, n):
        if comp(a[i], a[0]):  # beats the heap's top (the weakest kept): it takes the top's place
            value, a[i] = a[i], a[0]
            _adjust(a, 0, k, value, comp)
    return np.array(sorted(a[:k]), np.int64)


def _adjust(a: list[int], hole: int, size: int, value: int, comp: Less) -> None:
    """libstdc++'s ``__adjust_heap``: sift the hole at ``hole`` down to a leaf along the preferred
    children, then push ``value`` up from there (``__push_heap``), within a[0:size]."""
    top, child = hole, hole
    while child < (size - 1) // 2:
        child = 2 * (child + 1)
        if comp(a[child], a[child - 1]):
            child -= 1
        a[hole] = a[child]
        hole = child
    if size % 2 == 0 and child == (size - 2) // 2:
        child = 2 * (child + 1)
        a[hole] = a[child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and comp(a[parent], value):
        a[hole] = a[parent]
        hole = parent
        parent = (hole - 1) // 2
    a[hole] = value


@dataclass
class TieCount:
    """What the substituted selection met: rows selected, rows whose k-th score is exactly 0 with more
    zero-score keys than places left (the tie rule decides), rows whose selection the rule changed."""

    rows: int = 0
    zero_ties: int = 0
    changed: int = 0


def heap_select_step(count: TieCount) -> Callable[..., np.ndarray]:
    """A stand-in for :func:`kernels.attention.select_step.select_step` (same arguments, same result
    shape): the indexer's scores by the formula's reference (:func:`index_scores`), then :func:`heap_topk`
    for the engine's top-k; where no tie decides it selects what ``select_step`` does (tested). Counts
    into ``count``."""

    def select(qi: np.ndarray, weights: np.ndarray, key_blocks_of: Sequence[Sequence[np.ndarray]],
               k: int) -> np.ndarray:
        out = np.empty((qi.shape[0], k), np.int64)  # out: [B, k] i64
        for b, blocks in enumerate(key_blocks_of):
            length = sum(int(blk.shape[0]) for blk in blocks)
            scores = index_scores(qi[b : b + 1], weights[b : b + 1], blocks, length - 1)[0]  # [length] f32
            out[b] = heap_topk(scores, k)
            kth = np.partition(scores, length - k)[length - k]
            count.rows += 1
            count.zero_ties += int(kth == 0 and (scores == 0).sum() > k - (scores > 0).sum())
            count.changed += int(not np.array_equal(out[b], engine_topk(scores[None], length - 1, k)[0]))
        return out

    return select


def greedy_with_heap_ties(model_dir: Path, prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[
        list[list[int]], TieCount]:
    """Each prompt's ``max_tokens`` greedy tokens from our reference decoder (f32 cache) with llama.cpp's
    top-k tie rule in place of the engine's, and what the selections met."""
    model = load_model(model_dir)
    model.use_compiled = False  # the reference path: its selection is the one substituted
    count = TieCount()
    with mock.patch("kernels.model.glm_decoder.select_step", heap_select_step(count)):  # greedy: Sampler()'s default
        out = [generate(model, model.new_cache("f32"), prompt, max_tokens).tokens for prompt in prompts]
    return out, count


__all__ = ["TieCount", "greedy_with_heap_ties", "heap_select_step", "heap_topk"]
