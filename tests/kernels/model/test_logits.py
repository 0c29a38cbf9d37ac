"""One turn's draw: the logits processing (penalties, logit_bias, min_tokens) by its stated
formulas, log-probabilities of the processed logits, and the settings' checks and records."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.errors import FormatError
from kernels.model.logits import TurnDraw, log_softmax
from kernels.model.sampling import Sampler

V = 64


def _expected(logits: np.ndarray, context: list[int], drawn: list[int], s: Sampler, stop: set[int]) -> np.ndarray:
    """The module doc's four steps, written out per id (a loop, not the module's vector code)."""
    z = [float(x) for x in logits]
    seen = set(context) | set(drawn)
    for i in range(len(z)):
        if i in seen:
            z[i] = z[i] / s.repetition_penalty if z[i] > 0 else z[i] * s.repetition_penalty
        c = drawn.count(i)
        if c:
            z[i] -= c * s.frequency_penalty + s.presence_penalty
    for i, b in s.logit_bias:
        z[i] += b
    if len(drawn) < s.min_tokens:
        for i in stop:
            z[i] = -np.inf
    return np.asarray(z)


def test_processing_follows_the_formulas_step_by_step() -> None:
    rng = np.random.RandomState(3)
    s = Sampler(temperature=0.9, seed=5, presence_penalty=0.7, frequency_penalty=0.5, repetition_penalty=1.3,
                logit_bias=((2, 5.0), (7, -3.0)), min_tokens=3)
    context = [3, 4, 4, 9]
    draw = TurnDraw(s, stop_ids=frozenset({1, 2}))
    draw.begin(np.asarray(context))
    drawn: list[int] = []
    for position in range(40):
        logits = rng.standard_normal(V).astype(np.float32)  # [V] f32
        logits[drawn[-3:]] += 2.0  # make repeats likely, so the penalties have counts to act on
        want = _expected(logits, context, drawn, s, {1, 2})
        np.testing.assert_array_equal(draw.process(logits), want)
        drawn.append(draw(logits, position))
    assert len(set(drawn)) < len(drawn)  # repeats happened: counts above 1 were exercised
    assert not {1, 2} & set(drawn[:3])


def test_min_tokens_bans_stop_ids_until_reached() -> None:
    logits = np.zeros(V, np.float32)
    logits[5] = 10.0  # the eos id is by far the most likely
    draw = TurnDraw(Sampler(min_tokens=4), stop_ids=frozenset({5}))
    draw.begin(np.asarray([1]))
    tokens = [draw(logits, p) for p in range(6)]
    assert tokens[:4] != [5] * 4 and 5 not in tokens[:4] and tokens[4:] == [5, 5]


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    draw = TurnDraw(Sampler(logit_bias=((V, 1.0),)))
    draw.begin(np.asarray([1]))
    with pytest.raises(FormatError, match="outside the vocabulary"):
        draw(np.zeros(V, np.float32), 0)


def test_no_processing_draws_from_the_logits_as_given() -> None:
    logits = np.random.RandomState(1).standard_normal(V).astype(np.float32)
    draw = TurnDraw(Sampler(temperature=1.0, seed=2), top_logprobs=3)
    assert draw.process(logits) is logits
    s = Sampler(temperature=1.0, seed=2)
    assert [draw(logits, p) for p in range(20)] == [s(logits, p) for p in range(20)]
    first = draw.logprobs[0]
    lp = log_softmax(logits)
    assert first.logprob == lp[first.token] and [t for t, _ in first.top] == list(np.argsort(-lp)[:3])


def test_logprobs_are_of_the_processed_logits() -> None:
    logits = np.zeros(V, np.float32)
    draw = TurnDraw(Sampler(logit_bias=((4, 3.0),)), top_logprobs=1)
    draw.begin(np.asarray([0]))
    assert draw(logits, 0) == 4
    expected = 3.0 - np.log(np.exp(3.0) + V - 1)
    assert abs(draw.logprobs[0].logprob - expected) < 1e-12 and draw.logprobs[0].top == ((4, draw.logprobs[0].logprob),)


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -2.01}, {"repetition_penalty": 0.0},
    {"repetition_penalty": float("inf")}, {"min_tokens": -1}, {"min_tokens": True},
    {"logit_bias": {"5": 101}}, {"logit_bias": {"x": 1}}, {"logit_bias": {str(i): 1 for i in range(301)}},
    {"top_p": 0.0}, {"surprise": 1},
])
def test_bad_settings_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(FormatError):
        Sampler.checked(**fields)  # type: ignore[arg-type]


def test_settings_round_trip_and_defaults_stay_the_four_fields() -> None:
    assert Sampler().to_dict() == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
    s = Sampler.checked(1, 0, 0.9, 3, presence_penalty=1, logit_bias={"9": -2, "3": 1.5}, min_tokens=2,
                        repetition_penalty=1.1)
    assert s.logit_bias == ((3, 1.5), (9, -2.0)) and s.presence_penalty == 1.0
    assert s.to_dict()["logit_bias"] == {"3": 1.5, "9": -2.0} and "frequency_penalty" not in s.to_dict()
    assert Sampler.from_dict(s.to_dict()) == s
