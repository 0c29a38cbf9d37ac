"""A prompt chunk's rows share their session's keys and rows: the selection scores them laid across
vector lanes (kernels.attention.score_lanes) and attention decodes each row once
(kernels.attention.row_tables). Both must be bitwise what each row alone gives: every score is
``score_row``'s, every selection and context the lone row's, whatever shares the step."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention.row_tables import LANE_ROWS, attend_rows, select_rows, transpose_keys
from kernels.attention.score_lanes import KEYS, score_transposed
from kernels.attention.select_step import engine_topk, score_row
from kernels.fp8.tables import DECODE_TABLE

TOPK = 32


def odd_floats(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal floats with NaN, infinities, zeros of both signs and large values sprinkled in."""
    x = rng.standard_normal(shape).astype(np.float32)
    for value, share in ((np.nan, 0.01), (np.inf, 0.005), (-np.inf, 0.005), (0.0, 0.02), (-0.0, 0.02), (3e38, 0.003)):
        x[rng.random(shape) < share] = value
    return x


@settings(max_examples=40, deadline=None)
@given(nh=st.integers(1, 6), hd=st.integers(1, 70), t=st.integers(1, 90), seed=st.integers(0, 2**31))
def test_a_lane_score_is_score_row_bitwise(nh: int, hd: int, t: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    q, w, keys = odd_floats(rng, (nh, hd)), odd_floats(rng, (nh,)), odd_floats(rng, (t, hd))
    width = -(-t // KEYS) * KEYS
    keys_t = np.zeros((hd, width), np.float32)  # [hd, width], key j in column j
    keys_t[:, :t] = keys.T
    out = np.empty(width, np.float32)
    score_transposed(q, w, keys_t, t, out)
    want = np.array([score_row(q, w, keys[j]) for j in range(t)], np.float32)
    assert out[:t].tobytes() == want.tobytes()


def key_blocks(rng: np.random.Generator, length: int, cut: int, hd: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """A session's indexer keys in two blocks (cut at ``cut``), the second strided: its table [2, 4]."""
    first = odd_floats(rng, (cut, hd))
    wide = odd_floats(rng, (length - cut, 2 * hd))  # row stride twice the key: a block's rows need not abut
    table = np.array([[0, cut, first.ctypes.data, first.strides[0]],
                      [cut, length - cut, wide.ctypes.data, wide.strides[0]]], np.int64)
    return table, [first, wide]


def test_transposed_keys_are_the_blocks_columns() -> None:
    rng = np.random.default_rng(1)
    table, (first, wide) = key_blocks(rng, 50, 20, 8)
    keys_t = np.full((8, 48), 7.0, np.float32)
    transpose_keys(table, 37, keys_t)
    want = np.concatenate([first, wide[:, :8]])[:37].T
    assert keys_t[:, :37].tobytes() == want.tobytes()
    assert not keys_t[:, 37:].any()  # past what is seen: zeros, never stale floats


@pytest.mark.parametrize("hd", [32, 12])
def test_a_chunks_selections_are_each_rows_alone(hd: int) -> None:
    rng = np.random.default_rng(hd)
    (t0, keep0), (t1, keep1) = key_blocks(rng, 700, 300, hd), key_blocks(rng, 90, 41, hd)
    # a prompt chunk of session 0 (seeing 600-639 keys, some rows at or under k), session 1's rows around it
    owners = [1] + [0] * 40 + [1, 1] + [0] * (LANE_ROWS - 1)
    visible = np.array([80] + list(range(600, 640)) + [88, 20] + [TOPK, 5, 699][: LANE_ROWS - 1], np.int64)
    visible[7] = TOPK  # a row of the chunk that sees no more than k: it takes every key
    tables = np.stack([t0 if o == 0 else t1 for o in owners])
    n, nh = len(owners), 4
    qi, w = odd_floats(rng, (n, nh, hd)), rng.standard_normal((n, nh)).astype(np.float32)
    sel, counts = np.full((n, TOPK), -1, np.int64), np.zeros(n, np.int64)
    select_rows(qi, w, tables, visible, sel, counts)
    keys = {0: np.concatenate([keep0[0], keep0[1][:, :hd]]), 1: np.concatenate([keep1[0], keep1[1][:, :hd]])}
    for b in range(n):
        alone_sel, alone_counts = np.full((1, TOPK), -1, np.int64), np.zeros(1, np.int64)
        select_rows(qi[b : b + 1], w[b : b + 1], tables[b : b + 1], visible[b : b + 1], alone_sel, alone_counts)
        assert counts[b] == alone_counts[0] and np.array_equal(sel[b, : counts[b]], alone_sel[0, : counts[b]])
        if visible[b] > TOPK:
            scores = np.array([score_row(qi[b], w[b], key) for key in keys[owners[b]][: visible[b]]], np.float32)
            ref = np.empty(TOPK, np.int64)
            engine_topk(scores, ref)  # the definition: score_row's scores (w already scaled), the engine's cut
            assert np.array_equal(sel[b], ref)
        else:
            assert sel[b, : counts[b]].tolist() == list(range(visible[b]))
    del keep0, keep1  # the tables' arrays lived until here


def latent_blocks(rng: np.random.Generator, length: int, cut: int, width: int, rope: int) -> tuple[np.ndarray, list]:
    """A session's fp8 latent rows in two blocks, every code and some unusable scales: its table [2, 10]."""
    rows, keep = [], []
    for start, end in ((0, cut), (cut, length)):
        lc = rng.integers(0, 256, (end - start, width), dtype=np.uint8)
        rc = rng.integers(0, 256, (end - start, rope), dtype=np.uint8)
        lsc, rsc = odd_floats(rng, (end - start,)), np.abs(rng.standard_normal(end - start)).astype(np.float32)
        keep += [lc, rc, lsc, rsc]
        rows.append([start, end - start, lc.ctypes.data, lc.strides[0], lsc.ctypes.data, 4, rc.ctypes.data,
                     rc.strides[0], rsc.ctypes.data, 4])
    return np.array(rows, np.int64), keep


def test_a_chunks_contexts_are_each_rows_alone() -> None:
    rng = np.random.default_rng(3)
    heads, width, rope = 4, 64, 16
    (t0, keep0), (t1, keep1) = latent_blocks(rng, 400, 150, width, rope), latent_blocks(rng, 60, 60, width, rope)
    owners = [0] * 30 + [1] * 2 + [0] * 3 + [1] * LANE_ROWS
    seen = {0: 400, 1: 60}
    n = len(owners)
    sel, counts = np.zeros((n, TOPK), np.int64), np.zeros(n, np.int64)
    for b, o in enumerate(owners):
        counts[b] = min(TOPK, 9 + b)  # rows selecting fewer than k, then k
        sel[b, : counts[b]] = np.sort(rng.choice(seen[o] - b % 3, counts[b], replace=False))
    tables = np.stack([t0 if o == 0 else t1 for o in owners])
    qa, qr = odd_floats(rng, (n, heads, width)), rng.standard_normal((n, heads, rope)).astype(np.float32)
    ctx = np.zeros((n, heads, width), np.float32)
    attend_rows(qa, qr, tables, sel, counts, DECODE_TABLE, np.float32(0.125), ctx)
    for b in range(n):
        alone = np.zeros((1, heads, width), np.float32)
        attend_rows(qa[b : b + 1], qr[b : b + 1], tables[b : b + 1], sel[b : b + 1], counts[b : b + 1], DECODE_TABLE,
                    np.float32(0.125), alone)
        assert alone.tobytes() == ctx[b : b + 1].tobytes(), b
    del keep0, keep1
