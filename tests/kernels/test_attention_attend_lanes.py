"""``attend_one`` runs its dot products four keys at a time and its weighted sum of rows in
registers (kernels.attention.attend_lanes). Its floats must stay those of the scalar arithmetic it
documents, bitwise: each dot eight lane sums from 0 then ((0+1)+(2+3))+((4+5)+(6+7)) then the tail
in order, score = (dot_a * lsc + dot_r * rsc) * scale, p = exp(score - max), total and context summed
row by row in order. The oracle below is that arithmetic written as plain scalar loops. A NaN is
a NaN: which of two NaN operands an add passes on (its sign) is LLVM's to choose (``fadd``
commutes), so NaNs are compared as NaNs and every other float bitwise."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from kernels.attention.sparse_step import attend_one
from tests.kernels.test_attention_score_lanes import odd_floats


@njit(cache=False)
def _scalar_dot(a: np.ndarray, b: np.ndarray) -> np.float32:  # pragma: no cover - compiled
    full = a.shape[0] - a.shape[0] % 8
    lanes = np.zeros(8, np.float32)
    for i in range(full):
        lanes[i % 8] = lanes[i % 8] + a[i] * b[i]
    total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
    for i in range(full, a.shape[0]):
        total = total + a[i] * b[i]
    return total


@njit(cache=False)
def _scalar_attend(qa: np.ndarray, qr: np.ndarray, lc: np.ndarray, rc: np.ndarray, lsc: np.ndarray,
                   rsc: np.ndarray, scale: np.float32) -> np.ndarray:  # pragma: no cover - compiled
    heads, width = qa.shape
    k = lc.shape[0]
    ctx = np.zeros((heads, width), np.float32)
    scores = np.empty(k, np.float32)
    for h in range(heads):
        top = np.float32(-np.inf)
        for j in range(k):
            v = (_scalar_dot(qa[h], lc[j]) * lsc[j] + _scalar_dot(qr[h], rc[j]) * rsc[j]) * scale
            scores[j] = v
            if v > top:
                top = v
        total = np.float32(0.0)
        for j in range(k):
            p = np.float32(np.exp(scores[j] - top))
            total += p
            weight = p * lsc[j]
            for n in range(width):
                ctx[h, n] = ctx[h, n] + weight * lc[j, n]
        for n in range(width):
            ctx[h, n] = ctx[h, n] / total
    return ctx


@njit(cache=False)
def _kernel(qa: np.ndarray, qr: np.ndarray, lc: np.ndarray, rc: np.ndarray, lsc: np.ndarray, rsc: np.ndarray,
            scale: np.float32) -> np.ndarray:  # pragma: no cover - compiled
    ctx = np.full(qa.shape, np.float32(7.0))  # garbage in: every element must be written
    scores = np.empty(lc.shape[0], np.float32)
    attend_one(qa, qr, lc, rc, lsc, rsc, scale, scores, ctx)
    return ctx


@settings(max_examples=60, deadline=None)
@given(heads=st.integers(1, 5), width=st.sampled_from([1, 8, 13, 16, 24, 64, 70, 80, 128, 512]),
       rope=st.sampled_from([0, 3, 8, 16, 20]), k=st.integers(1, 41), odd=st.booleans(),
       seed=st.integers(0, 2**31))
def test_attend_one_is_its_scalar_arithmetic_bitwise(heads: int, width: int, rope: int, k: int, odd: bool,
                                                     seed: int) -> None:
    rng = np.random.default_rng(seed)
    make = (lambda s: odd_floats(rng, s)) if odd else (lambda s: rng.standard_normal(s).astype(np.float32))
    qa, qr, lc, rc = make((heads, width)), make((heads, rope)), make((k, width)), make((k, rope))
    lsc, rsc = rng.random(k).astype(np.float32), rng.random(k).astype(np.float32)
    lsc[rng.random(k) < 0.1] = 0.0  # a sanitised scale
    scale = np.float32(rng.random() + 0.01)
    got = _kernel(qa, qr, lc, rc, lsc, rsc, scale)
    want = _scalar_attend(qa, qr, lc, rc, lsc, rsc, scale)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.where(np.isnan(got), 0, got).tobytes() == np.where(np.isnan(want), 0, want).tobytes()
