"""One turn's draw: the logits of each position processed by the turn's settings, then drawn by the
:class:`Sampler`, with the log-probabilities of what was drawn when the turn asks for them.

The processing (FORMAT.md 7) depends only on the turn's settings, the tokens before the turn and the
tokens drawn in it, never on the batch or the process, so a turn with the same settings and seed
draws the same tokens after a resume and beside other sessions as alone. In f64, in this order:

1. ``repetition_penalty`` r (vLLM's): every id among the tokens before the draw (the turn's context
   and the tokens drawn so far): a logit > 0 is divided by r, any other multiplied by r;
2. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): each id drawn c > 0 times in this
   turn loses c * f + p;
3. ``logit_bias``: each listed id gains its bias;
4. ``min_tokens`` m: while fewer than m tokens were drawn, the turn's stop ids (its eos ids) are -inf;
5. a ``constraint`` (a grammar, ``response_format``): every id it does not allow next is -inf.

Log-probabilities are those of the distribution the token was drawn from BEFORE temperature, top-k
and top-p: ``log_softmax`` of the processed logits (in f64), the model's own ``log_softmax`` when the
turn has no processing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kernels.errors import FormatError
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


class TokenConstraint(Protocol):
    """What limits the next token (a grammar): the ids allowed next, and each drawn token consumed."""

    def allowed(self) -> np.ndarray: ...  # [V] bool
    def consume(self, token: int) -> None: ...


class TurnDraw:
    """One turn's draw (``draw(logits, position) -> token``, what the decode loop calls): each
    position's logits processed by the ``sampler``'s settings (module doc), then the sampler's draw;
    ``stop_ids``: the ids ``min_tokens`` bans (the turn's eos ids); with ``top_logprobs`` (0..20;
    None: off) each drawn token's :class:`TokenLogprob` (of the processed logits) is appended to
    ``logprobs``; ``constraint``: what else limits each token (a grammar). When
    :attr:`wants_context`, call :meth:`begin` with the turn's context before the first draw."""

    def __init__(self, sampler: Sampler, *, stop_ids: frozenset[int] = frozenset(),
                 top_logprobs: int | None = None, constraint: TokenConstraint | None = None) -> None:
        if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise FormatError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], found {top_logprobs}")
        self.sampler = sampler
        self.stop_ids = stop_ids
        self.top_logprobs = top_logprobs
        self.logprobs: list[TokenLogprob] = []
        self.drawn = 0  # tokens drawn in this turn
        self.constraint = constraint
        self._processing = bool(sampler.processing) or constraint is not None
        self._context = np.zeros(0, dtype=np.int64)  # [n] the ids before the turn (repetition_penalty)
        self._counts: np.ndarray | None = None  # [V] i64: times each id was drawn in this turn
        self._seen: np.ndarray | None = None  # [V] bool: ids in the context or drawn (repetition_penalty)

    @property
    def plain_greedy(self) -> bool:
        """Whether a draw is its logits' greedy pick and nothing more (greedy, no processing, no
        log-probabilities): a pick made for a whole batch (``sampling.greedy_rows``) may stand
        for it (:meth:`take`)."""
        return self.sampler.greedy and not self._processing and self.top_logprobs is None

    def take(self, token: int) -> int:
        """Record ``token``, the greedy pick made for the whole batch of this position's logits
        (only when :attr:`plain_greedy`): what a call with those logits does; returns it."""
        self.drawn += 1
        return token

    @property
    def wants_context(self) -> bool:
        """Whether the draw reads the tokens before the turn (``repetition_penalty``): a long
        session's token column is only gathered for it then."""
        return self.sampler.repetition_penalty != 1

    def begin(self, context: np.ndarray) -> None:
        """The turn starts after ``context`` [n] (every token before its first draw)."""
        if self.wants_context:
            self._context = np.unique(np.asarray(context, dtype=np.int64))  # [u] i64

    def process(self, logits: np.ndarray) -> np.ndarray:
        """The position's logits [V] after the turn's processing ([V] f64; as given without any)."""
        if not self._processing:
            return logits
        s = self.sampler
        z = np.array(logits, dtype=np.float64).reshape(-1)  # z: [V] f64 copy
        counts, seen = self._state(z.size)
        if s.repetition_penalty != 1:
            r = s.repetition_penalty
            z = np.where(seen, np.where(z > 0, z / r, z * r), z)  # [V] f64
        if s.frequency_penalty or s.presence_penalty:
            z -= counts * s.frequency_penalty + (counts > 0) * s.presence_penalty  # [V] f64
        if s.logit_bias:
            ids = np.asarray([i for i, _ in s.logit_bias], dtype=np.int64)  # [b] i64
            if int(ids[-1]) >= z.size:
                raise FormatError(f"logit_bias: token id {int(ids[-1])} is outside the vocabulary ({z.size})")
            z[ids] += np.asarray([b for _, b in s.logit_bias], dtype=np.float64)  # [b] f64
        if self.drawn < s.min_tokens and self.stop_ids:
            banned = np.asarray(sorted(i for i in self.stop_ids if 0 <= i < z.size), dtype=np.int64)  # [e] i64
            z[banned] = -np.inf
        if self.constraint is not None:
            allowed = self.constraint.allowed()  # [V] bool
            if allowed.shape != z.shape:
                raise FormatError(f"the constraint's mask covers {allowed.size} ids, the logits {z.size}")
            z[~allowed] = -np.inf
        return z

    def _state(self, vocab: int) -> tuple[np.ndarray, np.ndarray]:
        """The per-id counts of this turn's tokens [V] i64 and the ids seen [V] bool, made at the
        first draw (the vocabulary's size is the logits')."""
        if self._counts is None or self._seen is None:
            self._counts = np.zeros(vocab, dtype=np.int64)  # [V] i64
            self._seen = np.zeros(vocab, dtype=bool)  # [V] bool
            self._seen[self._context[self._context < vocab]] = True
        return self._counts, self._seen

    def __call__(self, logits: np.ndarray, position: int) -> int:
        s = self.sampler
        z = self.process(logits)  # [V]
        token = sample(z, seed=s.seed, position=position, temperature=s.temperature, top_k=s.top_k,
                       top_p=s.top_p)
        if self.top_logprobs is not None:
            self.logprobs.append(token_logprob(z, token, self.top_logprobs))
        self.drawn += 1
        if self.constraint is not None:
            self.constraint.consume(token)
        if self._processing:
            counts, seen = self._state(np.asarray(logits).size)
            counts[token] += 1
            seen[token] = True
        return token


def turn_draw(sampler: Sampler | TurnDraw, stop_ids: frozenset[int] = frozenset()) -> TurnDraw:
    """``sampler`` as a turn's draw (a :class:`TurnDraw` as it is; settings wrapped in a new one
    whose ``min_tokens`` bans ``stop_ids``)."""
    return sampler if isinstance(sampler, TurnDraw) else TurnDraw(sampler, stop_ids=stop_ids)


def settings_of(sampler: Sampler | TurnDraw) -> Sampler:
    """The settings a turn is drawn with (what a session records with the turn)."""
    return sampler.sampler if isinstance(sampler, TurnDraw) else sampler


__all__ = ["MAX_TOP_LOGPROBS", "TokenConstraint", "TokenLogprob", "TurnDraw", "log_softmax", "settings_of",
           "token_logprob", "turn_draw"]
