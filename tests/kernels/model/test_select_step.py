"""The decode step's DSA selection (kernels.attention.select_step): the engine's top-k of the
float64 reference scores, the tie rule, the same selection however the keys are split or laid
out, and row b the same alone or in any batch."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.attention.select_step import engine_topk, score_row, select_step
from kernels.attention.selection import select_rows
from kernels.errors import FormatError
from tests.kernels.model.test_glm_selection import HD, NH, reference_scores, reference_topk, split


def sessions(seed: int, lengths: list[int]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    qi = rng.standard_normal((len(lengths), NH, HD)).astype(np.float32)  # [B, nh, hd]
    w = rng.standard_normal((len(lengths), NH)).astype(np.float32)  # [B, nh]
    return qi, w, [rng.standard_normal((t, HD)).astype(np.float32) for t in lengths]


def test_selection_is_the_engine_top_k_of_the_reference_scores() -> None:
    lengths = [40, 300, 5000]
    qi, w, keys = sessions(0, lengths)
    got = select_step(qi, w, [[k] for k in keys], 32)
    assert got.shape == (3, 32) and got.dtype == np.int64
    for b, t in enumerate(lengths):
        ref = reference_scores(qi[b : b + 1], w[b : b + 1], keys[b], t - 1)[0]
        assert got[b].tolist() == reference_topk(ref, 32)
        assert np.array_equal(got[b : b + 1], select_rows(qi[b : b + 1], w[b : b + 1], [keys[b]], t - 1, 32))


def test_ties_and_nan_follow_the_engine_rule() -> None:
    qi, w, _ = sessions(1, [12])
    keys = np.zeros((12, HD), np.float32)  # every score 0: all tie, the lowest positions win
    assert select_step(qi, w, [[keys]], 5).tolist() == [[0, 1, 2, 3, 4]]
    keys[7] = np.nan  # a NaN score counts as -inf: never taken while others remain
    keys[9] = 10 * qi[0, 0] * np.sign(w[0, 0])  # one clear winner
    got = select_step(qi, w, [[keys]], 11)[0].tolist()
    assert 9 in got and 7 not in got and got == sorted(got)


@pytest.mark.parametrize("cuts", [[1], [100, 101], [2999]])
def test_selection_does_not_depend_on_blocks_or_layout(cuts: list[int]) -> None:
    qi, w, keys = sessions(2, [3000])
    whole = select_step(qi, w, [[keys[0]]], 64)
    records = np.zeros(3000, dtype=[("tok", "<i4"), ("ic", "<f4", (2, HD))])  # file-like strided rows
    records["ic"][:, 1] = keys[0]
    mapped = records["ic"][:, 1]
    mapped.flags.writeable = False  # a read-only mapping
    for blocks in (split(keys[0], cuts), split(records["ic"][:, 1], cuts), split(mapped, cuts)):
        assert np.array_equal(select_step(qi, w, [blocks], 64), whole)


def lane_tree_score(qi: np.ndarray, w: np.ndarray, key: np.ndarray) -> np.float32:
    """score_row's arithmetic in numpy's f32 (each op rounded as IEEE f32): lane i sums
    qi[h, 8k + i] * key[8k + i] over k, the lanes added ((0+1)+(2+3))+((4+5)+(6+7)), the tail in order."""
    full = key.size - key.size % 8
    total = np.float32(0)
    for h in range(qi.shape[0]):
        lanes = np.zeros(8, np.float32)  # [8] f32
        for k in range(0, full, 8):
            lanes = lanes + qi[h, k:k + 8] * key[k:k + 8]
        dot = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
        for i in range(full, key.size):
            dot = dot + qi[h, i] * key[i]
        total = total + w[h] * (np.float32(0) if dot <= 0 else dot)
    return np.float32(total)


@pytest.mark.parametrize("hd", [32, 36])
def test_a_score_is_the_lane_tree_bitwise_whether_the_key_floats_are_adjacent_or_strided(hd: int) -> None:
    rng = np.random.default_rng(5)
    qi = rng.standard_normal((NH, hd)).astype(np.float32)  # [nh, hd]
    w = rng.standard_normal(NH).astype(np.float32)  # [nh]
    keys = rng.standard_normal((50, hd)).astype(np.float32)  # [t, hd], adjacent floats (the vector path)
    spread = np.zeros((50, 2 * hd), np.float32)
    spread[:, ::2] = keys
    strided = spread[:, ::2]  # [t, hd] with a float between each two: the lane-by-lane path
    for t in range(keys.shape[0]):
        want = lane_tree_score(qi, w, keys[t])
        assert np.float32(score_row(qi, w, keys[t])).tobytes() == want.tobytes()
        assert np.float32(score_row(qi, w, strided[t])).tobytes() == want.tobytes()


@pytest.mark.parametrize("order", ["shuffled", "ascending", "descending"])
@pytest.mark.parametrize("k", [1, 5, 32])
def test_the_top_k_cut_is_the_engine_rule_with_ties_nan_and_infinities(order: str, k: int) -> None:
    rng = np.random.default_rng(k)
    for n in (k + 1, 3 * k, 700):
        row = rng.integers(-4, 5, n).astype(np.float32)  # [n] f32: few values, many ties
        row[rng.random(n) < 0.1] = np.nan
        row[rng.random(n) < 0.05] = -np.inf
        row[rng.random(n) < 0.02] = np.inf
        if order != "shuffled":
            row = np.sort(row) if order == "ascending" else np.sort(row)[::-1].copy()
        want = reference_topk(np.where(np.isnan(row), -np.inf, row), k)
        out = np.empty(k, np.int64)
        engine_topk(row, out)
        assert out.tolist() == want, (n, row.tolist())
    nan = np.full(k + 3, np.nan, np.float32)  # every score NaN: all -inf, the lowest positions
    out = np.empty(k, np.int64)
    engine_topk(nan, out)
    assert out.tolist() == list(range(k))


def test_a_row_is_the_same_alone_or_in_any_batch() -> None:
    lengths = [33, 90, 33, 700, 64]
    qi, w, keys = sessions(3, lengths)
    batch = select_step(qi, w, [[k] for k in keys], 32)
    for b in range(len(lengths)):
        assert np.array_equal(select_step(qi[b : b + 1], w[b : b + 1], [[keys[b]]], 32), batch[b : b + 1])
    order = [4, 2, 0, 3, 1]
    shuffled = select_step(qi[order], w[order], [[keys[b]] for b in order], 32)
    assert np.array_equal(shuffled, batch[order])


def test_refusals() -> None:
    qi, w, keys = sessions(4, [8])
    with pytest.raises(FormatError, match="more than k"):
        select_step(qi, w, [[keys[0]]], 8)
    with pytest.raises(FormatError, match="float32"):
        select_step(qi, w, [[keys[0].astype(np.float64)]], 4)
    with pytest.raises(FormatError, match="sessions"):
        select_step(qi, w, [], 4)
