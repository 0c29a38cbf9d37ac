"""DSA selection: the indexer's scores against a float64 reference, the engine's top-k tie rule,
and the same scores and selection however the keys are split into blocks."""
from __future__ import annotations

import numpy as np
import pytest

import kernels.attention.selection as selection
from kernels.attention import engine_topk, index_scores, select_rows
from kernels.errors import FormatError

NH, HD = 8, 32


def reference_scores(qi: np.ndarray, w: np.ndarray, keys: np.ndarray, first_pos: int) -> np.ndarray:
    """score[s, t] = sum_h w[s, h] * relu(qi[s, h] . keys[t] / sqrt(hd)) in float64; -inf after the query."""
    dots = np.einsum("shd,td->sht", qi.astype(np.float64), keys.astype(np.float64)) / np.sqrt(qi.shape[2])
    sc = np.einsum("sh,sht->st", w.astype(np.float64), np.maximum(dots, 0.0))
    n_q, length = qi.shape[0], first_pos + qi.shape[0]
    future = np.arange(length)[None, :] > (first_pos + np.arange(n_q))[:, None]
    return np.where(future, -np.inf, sc[:, :length])


def reference_topk(row: np.ndarray, k: int) -> list[int]:
    """The engine's rule, written out: above the k-th largest, then ties in position order, ascending."""
    thr = sorted(row.tolist(), reverse=True)[k - 1]
    above = [t for t, v in enumerate(row) if v > thr]
    ties = [t for t, v in enumerate(row) if v == thr][: k - len(above)]
    return sorted(above + ties)


def data(seed: int, n_q: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    qi = rng.standard_normal((n_q, NH, HD)).astype(np.float32)  # [S, nh, hd]
    w = rng.standard_normal((n_q, NH)).astype(np.float32)  # [S, nh]
    keys = rng.standard_normal((length, HD)).astype(np.float32)  # [T, hd]
    return qi, w, keys


def test_scores_match_a_float64_reference() -> None:
    qi, w, keys = data(0, 5, 300)
    got = index_scores(qi, w, [keys], first_pos=295)
    ref = reference_scores(qi, w, keys, 295)
    assert got.shape == (5, 300) and got.dtype == np.float32
    assert np.array_equal(np.isinf(got), np.isinf(ref))  # exactly the future keys are -inf
    finite = np.isfinite(ref)
    assert np.max(np.abs(got[finite] - ref[finite])) / np.max(np.abs(ref[finite])) < 1e-5


@pytest.mark.parametrize(
    "row, k, want",
    [
        ([1, 3, 3, 3, 2, 3], 3, [1, 2, 3]),  # four tie at the threshold: the three lowest positions
        ([5, 1, 5, 5], 2, [0, 2]),
        ([4, 9, 4, 7, 4], 3, [0, 1, 3]),  # two above, then the first tie
        ([0, 0, 0, 0, 0], 2, [0, 1]),  # ReLU zeros: all tie
        ([2, 1, 0, 3], 3, [0, 1, 3]),  # no tie
        ([1, np.nan, 1, 0], 2, [0, 2]),  # NaN counts as -inf
    ],
)
def test_engine_tie_rule(row: list[float], k: int, want: list[int]) -> None:
    scores = np.array([row], dtype=np.float32)
    assert engine_topk(scores, len(row) - 1, k).tolist() == [want]


def test_ties_never_take_a_future_key() -> None:
    scores = np.array([[7, 7, 7, 7, 7, 7], [7, 7, 7, 7, 7, 7]], np.float32)  # query 0 at position 4, 1 at 5
    assert engine_topk(scores, 4, 3).tolist() == [[0, 1, 2], [0, 1, 2]]
    scores[:, 5] = 100.0  # the best key: visible to query 1 only
    assert engine_topk(scores, 4, 3).tolist() == [[0, 1, 2], [0, 1, 5]]


def test_random_ties_follow_the_written_out_rule() -> None:
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 6, size=(40, 64)).astype(np.float32)  # many ties at every threshold
    got = engine_topk(scores, 24, 9)  # queries at positions 24..63
    for s in range(40):
        assert got[s].tolist() == reference_topk(scores[s, : 24 + s + 1], 9)


def test_engine_topk_refuses_a_context_not_longer_than_k() -> None:
    with pytest.raises(FormatError, match="more than k"):
        engine_topk(np.zeros((1, 8), np.float32), 7, 8)


def split(keys: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    edges = [0, *cuts, keys.shape[0]]
    return [keys[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]


@pytest.mark.parametrize("cuts", [[1], [100, 101, 4000], [4095, 4097], [2000, 6000, 8191]])
def test_scores_and_selection_do_not_depend_on_the_block_split(cuts: list[int]) -> None:
    qi, w, keys = data(1, 3, 9000)  # three tiles of KEY_TILE keys
    whole_scores = index_scores(qi, w, [keys], 8997)
    whole = select_rows(qi, w, [keys], 8997, 64)
    records = np.zeros(9000, dtype=[("tok", "<i4"), ("ic", "<f4", (2, HD))])  # file-like strided rows
    records["ic"][:, 1] = keys
    for blocks in (split(keys, cuts), split(records["ic"][:, 1], cuts)):
        assert np.array_equal(index_scores(qi, w, blocks, 8997), whole_scores)
        assert np.array_equal(select_rows(qi, w, blocks, 8997, 64), whole)


def test_select_rows_in_query_chunks_equals_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    qi, w, keys = data(2, 30, 200)
    whole = select_rows(qi, w, [keys], 170, 32)
    monkeypatch.setattr(selection, "SCORE_BUDGET_BYTES", 1)  # one query per chunk
    assert np.array_equal(select_rows(qi, w, [keys], 170, 32), whole)
    ref = reference_scores(qi, w, keys, 170)
    for s in range(30):
        assert whole[s].tolist() == reference_topk(ref[s, : 170 + s + 1], 32)


def test_index_scores_refusals() -> None:
    qi, w, keys = data(0, 2, 10)
    with pytest.raises(FormatError, match="index_scores"):
        index_scores(qi, w, [keys], 9)  # the second query would sit at position 10 of 10 keys
    with pytest.raises(FormatError, match="float32"):
        index_scores(qi, w, [keys.astype(np.float64)], 0)
