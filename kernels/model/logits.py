"""One turn's draw: the logits of each position processed by the turn's settings, then drawn by the
:class:`Sampler`, with the log-probabilities of what was drawn when the turn asks for them.

The processing (FORMAT.md 7, "Sampling") depends only on the turn's settings, the tokens before the
turn and the tokens drawn in it, never on the batch or the process, so a turn with the same settings
and seed draws the same tokens after a resume and beside other sessions as alone.

Log-probabilities are those of the distribution the token was drawn from BEFORE temperature, top-k
and top-p: ``log_softmax`` of the processed logits (in f64), the model's own ``log_softmax`` when the
turn has no processing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.model.sampling import Sampler, sample

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One drawn token's log-probability and the ``top`` most likely tokens of its distribution
    (descending log-probability, ties by ascending id; at most the turn's ``top_logprobs``)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log(softmax(logits))`` of one position, in f64 (-inf stays -inf; NaN counts as -inf)."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)  # z: [V] f64
    z = np.where(np.isnan(z), -np.inf, z)
    top = float(z.max())
    shifted = z - top  # [V] f64, max 0
    lp: np.ndarray = shifted - np.log(np.exp(shifted).sum())  # lp: [V] f64
    return lp


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under ``logits`` [V] and the ``top`` most likely tokens."""
    lp = log_softmax(logits)  # lp: [V] f64
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, lp.size)
        part = np.argpartition(-lp, k - 1)[:k]  # [k] the k largest, unordered
        order = part[np.lexsort((part, -lp[part]))]  # [k] descending value, ties by ascending id
        best = tuple((int(i), float(lp[i])) for i in order)
    return TokenLogprob(int(token), float(lp[token]), best)


class TurnDraw:
    """One turn's draw (``draw(logits, position) -> token``, what the decode loop calls): the
    ``sampler``'s draw over each position's logits; with ``top_logprobs`` (0..20; None: off) each
    drawn token's :class:`TokenLogprob` is appended to ``logprobs``."""

    def __init__(self, sampler: Sampler, *, top_logprobs: int | None = None) -> None:
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], found {top_logprobs}")
        self.sampler = sampler
        self.top_logprobs = top_logprobs
        self.logprobs: list[TokenLogprob] = []
        self.drawn = 0  # tokens drawn in this turn

    def begin(self, context: np.ndarray) -> None:
        """The turn starts after ``context`` [n] (every token before its first draw)."""

    def __call__(self, logits: np.ndarray, position: int) -> int:
        s = self.sampler
        token = sample(logits, seed=s.seed, position=position, temperature=s.temperature, top_k=s.top_k,
                       top_p=s.top_p)
        if self.top_logprobs is not None:
            self.logprobs.append(token_logprob(logits, token, self.top_logprobs))
        self.drawn += 1
        return token


def turn_draw(sampler: Sampler | TurnDraw) -> TurnDraw:
    """``sampler`` as a turn's draw (a :class:`TurnDraw` as it is; settings wrapped in a new one)."""
    return sampler if isinstance(sampler, TurnDraw) else TurnDraw(sampler)


def settings_of(sampler: Sampler | TurnDraw) -> Sampler:
    """The settings a turn is drawn with (what a session records with the turn)."""
    return sampler.sampler if isinstance(sampler, TurnDraw) else sampler


__all__ = ["MAX_TOP_LOGPROBS", "TokenLogprob", "TurnDraw", "log_softmax", "settings_of", "token_logprob",
           "turn_draw"]
