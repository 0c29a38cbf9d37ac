"""Counter-based sampling: a draw depends only on (seed, position, logits)."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.errors import FormatError
from kernels.model.sampling import Sampler, greedy_rows, sample, splitmix64, uniform


def test_splitmix64_reference_vector() -> None:
    # first output of the reference splitmix64 generator seeded with 0 (Vigna's splitmix64.c)
    assert splitmix64(0) == 0xE220A8397B1DCDAF


def test_uniform_range_and_determinism() -> None:
    us = [uniform(7, p) for p in range(2000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert us == [uniform(7, p) for p in range(2000)]
    assert abs(np.mean(us) - 0.5) < 0.03
    assert uniform(7, 5) != uniform(8, 5) and uniform(7, 5) != uniform(7, 6)


def test_same_seed_and_position_same_token_whatever_came_before() -> None:
    logits = np.random.RandomState(0).standard_normal(300).astype(np.float32)
    s = Sampler(temperature=1.0, top_k=50, top_p=0.95, seed=42)
    forward = [s(logits, p) for p in range(100)]
    backward = [s(logits, p) for p in reversed(range(100))][::-1]
    assert forward == backward
    assert len(set(forward)) > 10  # it does sample, not argmax
    assert s(logits, 17) == sample(logits, seed=42, position=17, temperature=1.0, top_k=50, top_p=0.95)


def test_greedy_is_first_argmax_and_ignores_seed() -> None:
    logits = np.array([0.5, 3.0, -1.0, 3.0], np.float32)
    assert {Sampler(seed=s)(logits, p) for s in range(5) for p in range(5)} == {1}
    assert sample(np.array([np.nan, 1.0, 2.0])) == 2


def test_distribution_follows_softmax_over_positions() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    n = 20000
    counts = np.bincount([sample(logits, seed=3, position=p, temperature=1.0) for p in range(n)], minlength=4)
    assert np.allclose(counts / n, [0.5, 0.3, 0.15, 0.05], atol=0.015)


def test_temperature_sharpens() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    cold = [sample(logits, seed=1, position=p, temperature=0.2) for p in range(2000)]
    assert np.mean(np.array(cold) == 0) > 0.9


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = np.log(np.array([0.05, 0.5, 0.15, 0.3]))
    top2 = {sample(logits, seed=5, position=p, temperature=1.0, top_k=2) for p in range(500)}
    assert top2 == {1, 3}
    nucleus = {sample(logits, seed=5, position=p, temperature=1.0, top_p=0.75) for p in range(500)}
    assert nucleus == {1, 3}  # 0.5 alone is short of 0.75, 0.5 + 0.3 reaches it
    assert {sample(logits, seed=5, position=p, temperature=1.0, top_k=1) for p in range(50)} == {1}
    assert {sample(logits, seed=5, position=p, temperature=1.0, top_p=1e-6) for p in range(50)} == {1}


def test_ties_break_by_lower_id() -> None:
    logits = np.zeros(10)
    assert {sample(logits, seed=9, position=p, temperature=1.0, top_k=3) for p in range(300)} == {0, 1, 2}


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 1 << 64}, "seed"),
    ],
)
def test_invalid_parameters(kwargs: dict, text: str) -> None:
    with pytest.raises(FormatError, match=text):
        Sampler(**kwargs)


def test_bad_logits() -> None:
    with pytest.raises(FormatError, match="empty"):
        sample(np.zeros(0))
    with pytest.raises(FormatError, match="-inf or NaN"):
        sample(np.array([-np.inf, np.nan]), temperature=1.0)
    with pytest.raises(FormatError, match=r"\+inf"):
        sample(np.array([np.inf, 1.0]), temperature=1.0)


def test_round_trip_through_dict() -> None:
    s = Sampler(temperature=0.7, top_k=5, top_p=0.9, seed=123)
    assert Sampler.from_dict(s.to_dict()) == s


@pytest.mark.parametrize("row", [
    [1.0, 3.0, 3.0, 2.0],  # ties: the first
    [np.nan, 1.0, 2.0],  # NaN counts as -inf
    [2.0, np.nan, 5.0, 5.0],
    [-np.inf, -1.0, -np.inf],
    [np.inf, 1.0, np.inf],  # greedy takes the first +inf
    [-3.0e38, -3.4e38],
])
def test_greedy_on_f32_logits_is_the_f64_rule(row: list[float]) -> None:
    f32 = np.array(row, dtype=np.float32)  # the decoder's logits: read in place
    z = np.where(np.isnan(np.array(row, dtype=np.float64)), -np.inf, np.array(row, dtype=np.float64))
    assert sample(f32) == sample(f32.astype(np.float64)) == int(np.argmax(z))


def test_greedy_refuses_all_minus_inf_and_nan() -> None:
    for row in ([-np.inf, -np.inf], [np.nan, np.nan], [np.nan, -np.inf]):
        with pytest.raises(FormatError, match="-inf or NaN"):
            sample(np.array(row, dtype=np.float32))


def test_greedy_rows_is_each_rows_own_greedy_draw_nan_and_inf_left_to_sample() -> None:
    rng = np.random.default_rng(36)
    rows = rng.standard_normal((40, 97)).astype(np.float32)  # [B, V] f32
    rows[1, [5, 60]] = rows[1].max() + 1  # a tie: the first maximum
    rows[2, 7] = np.nan  # a NaN before the maximum: sample's full path decides
    rows[3, :] = -np.inf  # nothing finite: sample raises, the batch makes no pick
    rows[3, 50] = 2.0
    rows[4, :] = -np.inf
    rows[5, 9] = np.inf
    picks = greedy_rows(rows)
    assert picks.shape == (40,) and picks.dtype == np.int64
    for b, row in enumerate(rows):
        if picks[b] >= 0:
            assert picks[b] == sample(row.copy())
        else:
            assert b in (2, 4)
    assert picks[1] == 5 and picks[3] == 50 and picks[5] == 9
    for b, row in enumerate(rows):  # one row alone (a lone stream's step) gives its pick in the batch
        assert greedy_rows(row[None]).tolist() == [picks[b]]
