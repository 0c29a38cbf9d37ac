"""A running turn advanced with a batched step's greedy pick takes it when its draw is plain
greedy, and draws itself otherwise (log-probabilities, processing, sampling, plain logits)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from kernels.model.logits import TurnDraw
from kernels.model.sampling import Sampler
from sessionstore.sessions import RunningTurn


def _logits(best: int) -> np.ndarray:
    row = np.zeros(16, np.float32)  # [V] f32
    row[best] = 1.0
    return row


def _second_token(draw: TurnDraw, logits: np.ndarray, pick: int = -1) -> int:
    """The token the turn draws once advanced with ``logits`` and the step's ``pick`` (its first
    drawn from a row whose argmax is 2)."""
    cache = SimpleNamespace(length=3)
    turn = RunningTurn(cache, _logits(2), 4, draw, frozenset(), None, None)  # type: ignore[arg-type]
    turn.start()
    token = turn.advance(logits, pick)
    assert token is not None
    return token


def test_a_plain_greedy_draw_takes_the_steps_pick_and_counts_it() -> None:
    draw = TurnDraw(Sampler())
    # the pick 9 stands for the row's own argmax (5): proof that the loop took it, not drew again
    assert _second_token(draw, _logits(5), 9) == 9
    assert draw.drawn == 2


def test_other_draws_draw_from_the_row_themselves() -> None:
    assert _second_token(TurnDraw(Sampler()), _logits(5), -1) == 5  # no pick made
    assert _second_token(TurnDraw(Sampler()), _logits(5)) == 5  # no pick given (drive_inline)
    with_logprobs = TurnDraw(Sampler(), top_logprobs=1)
    assert _second_token(with_logprobs, _logits(5), 9) == 5
    assert len(with_logprobs.logprobs) == 2
    biased = TurnDraw(Sampler(logit_bias=((7, 5.0),)))
    assert _second_token(biased, _logits(5), 5) == 7
    sampled = TurnDraw(Sampler(temperature=0.7, seed=1))
    assert not sampled.plain_greedy and _second_token(sampled, _logits(5), 5) in range(16)
