"""Token sampling with no hidden state: the draw for a position depends only on (seed, position, logits).

Greedy (temperature 0) takes the first maximum. Otherwise the logits are divided by the
temperature, sorted (descending value, ties by ascending id), cut to ``top_k`` and then to the
smallest prefix whose probability reaches ``top_p``; one uniform number u in [0, 1) derived by
hashing (seed, position) with splitmix64 picks the token by inverse CDF over that prefix. A
resumed session therefore samples exactly what an uninterrupted one would.

The settings also hold a turn's logits processing (penalties, ``logit_bias``, ``min_tokens``),
which needs the turn's tokens and so is applied by :class:`kernels.model.logits.TurnDraw` before
this draw; ``Sampler.__call__`` alone draws from the logits as given.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kernels.errors import FormatError

_MASK64 = (1 << 64) - 1
PENALTY_RANGE = 2.0  # presence_penalty / frequency_penalty in [-2, 2] (OpenAI's range)
BIAS_RANGE = 100.0  # each logit_bias value in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
PROCESSING = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens")


def splitmix64(x: int) -> int:
    """One splitmix64 step (Steele, Lea, Flood 2014) on a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """A uniform float in [0, 1) (53 random bits) that depends only on (seed, position)."""
    h = splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (h >> 11) * 2.0**-53


@dataclass(frozen=True)
class Sampler:
    """Sampling settings, and the draw they make (``sampler(logits, position)``): the one sampling
    type, which a session's manifest stores, a turn records, the API and the CLI fill. ``temperature``
    0 means greedy; ``top_k`` 0 and ``top_p`` 1 disable the cuts.

    The turn's logits processing (defaults: none), applied by ``TurnDraw``: ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's, over the tokens drawn in this turn), ``repetition_penalty``
    (vLLM's, over every token before the draw, the prompt included), ``logit_bias`` ((id, bias)
    pairs in ascending id order) and ``min_tokens`` (eos ids banned until that many were drawn)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise FormatError(f"sampling: temperature must be a finite number >= 0, found {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise FormatError(f"sampling: top_k must be an integer >= 0, found {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise FormatError(f"sampling: top_p must be in (0, 1], found {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= _MASK64:
            raise FormatError(f"sampling: seed must be an integer in [0, 2^64), found {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number_in(getattr(self, name), -PENALTY_RANGE, PENALTY_RANGE):
                raise FormatError(f"sampling: {name} must be in [-2, 2], found {getattr(self, name)!r}")
        rp = self.repetition_penalty
        if not (_number_in(rp, 0, math.inf) and rp > 0):
            raise FormatError(f"sampling: repetition_penalty must be a finite number > 0, found {rp!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise FormatError(f"sampling: min_tokens must be an integer >= 0, found {self.min_tokens!r}")
        _check_bias(self.logit_bias)

    @classmethod
    def checked(cls, temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0, seed: Any = 0,
                **processing: Any) -> Sampler:
        """Settings from values as given (a flag, a request body, a file): checked by the rules
        above as given (FormatError names the bad one), then stored as float temperature / top_p /
        penalties, int top_k / seed / min_tokens; ``processing``: the :data:`PROCESSING` fields
        (``logit_bias`` as pairs or as a mapping id -> bias, its ids ints or decimal strings)."""
        unknown = sorted(set(processing) - set(PROCESSING))
        if unknown:
            raise FormatError(f"sampling: unknown setting {unknown[0]!r}")
        if "logit_bias" in processing:
            processing["logit_bias"] = bias_pairs(processing["logit_bias"])
        cls(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **processing)  # the values as given
        numbers = {k: float(v) for k, v in processing.items() if k.endswith("_penalty")}
        if "min_tokens" in processing:
            numbers["min_tokens"] = int(processing["min_tokens"])
        return cls(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=int(seed),
                   **{**processing, **numbers})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processing(self) -> dict[str, Any]:
        """The logits-processing settings that differ from the defaults (empty: none)."""
        base = Sampler()
        return {k: getattr(self, k) for k in PROCESSING if getattr(self, k) != getattr(base, k)}

    def __call__(self, logits: np.ndarray, position: int) -> int:
        return sample(logits, seed=self.seed, position=position, temperature=self.temperature,
                      top_k=self.top_k, top_p=self.top_p)

    def to_dict(self) -> dict[str, Any]:
        """The four draw settings, and the processing settings that are not the defaults
        (``logit_bias`` as an object {"id": bias}, as JSON has it)."""
        out = {k: v for k, v in asdict(self).items() if k not in PROCESSING}
        extra = self.processing
        if "logit_bias" in extra:
            extra["logit_bias"] = {str(i): b for i, b in self.logit_bias}
        return {**out, **extra}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sampler:
        """Settings from :meth:`to_dict`'s shape (a file's record of them, FORMAT.md 5.8), checked: the
        four draw settings must be there (absent: a FormatError naming it), the processing settings
        that are absent are the defaults; other keys are ignored."""
        return cls.checked(d.get("temperature"), d.get("top_k"), d.get("top_p"), d.get("seed"),
                           **{k: d[k] for k in PROCESSING if k in d})


def _number_in(value: Any, lo: float, hi: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and lo <= value <= hi)


def bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (id, bias) pairs in ascending id order, from pairs or a mapping id -> bias
    (ids as ints or decimal strings, as JSON objects spell them); values are checked by the Sampler."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(int(k) if isinstance(k, str) and k.isdecimal() else k, v) for k, v in items]
    except (TypeError, ValueError):
        raise FormatError("sampling: logit_bias must map token ids to numbers") from None
    for k, v in pairs:
        if isinstance(k, bool) or not isinstance(k, int):
            raise FormatError(f"sampling: logit_bias keys must be token ids, found {k!r}")
        if not _number_in(v, -BIAS_RANGE, BIAS_RANGE):
            raise FormatError(f"sampling: logit_bias values must be in [-100, 100], found {v!r} for {k}")
    return tuple(sorted((k, float(v)) for k, v in pairs))


def _check_bias(bias: Any) -> None:
    if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
        raise FormatError(f"sampling: logit_bias must hold at most {MAX_LOGIT_BIAS} (id, bias) pairs")
    last = -1
    for pair in bias:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise FormatError("sampling: logit_bias must hold (id, bias) pairs")
        k, v = pair
        if isinstance(k, bool) or not isinstance(k, int) or k <= last:
            raise FormatError(f"sampling: logit_bias ids must be distinct ints >= 0 in ascending order, found {k!r}")
        if not _number_in(v, -BIAS_RANGE, BIAS_RANGE):
            raise FormatError(f"sampling: logit_bias values must be in [-100, 100], found {v!r} for {k}")
        last = k


def sample(
    logits: np.ndarray,
    *,
    seed: int = 0,
    position: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> int:
    """The token id drawn from ``logits`` [vocab] for absolute ``position`` (see the module doc)."""
    if temperature == 0:  # greedy: the first maximum, read in place (a widening copy orders values the same)
        flat = np.asarray(logits).reshape(-1)  # flat: [V] view
        if flat.size and flat.dtype.kind == "f":
            best = int(np.argmax(flat))  # argmax stops at the first NaN: that case is left to the full path
            top = float(flat[best])
            if top == top and top != -math.inf:
                return best
    z = np.asarray(logits, dtype=np.float64).reshape(-1)  # z: [V] f64 copy
    if z.size == 0:
        raise FormatError("sampling: empty logits")
    z = np.where(np.isnan(z), -np.inf, z)
    if not np.isfinite(z.max()) and z.max() < 0:
        raise FormatError("sampling: every logit is -inf or NaN")
    if temperature == 0:
        return int(np.argmax(z))
    if position < 0:
        raise FormatError(f"sampling: position must be >= 0, found {position}")
    if np.isposinf(z).any():
        raise FormatError("sampling: logits contain +inf")
    z = z / temperature
    order = np.lexsort((np.arange(z.size), -z))  # [V] descending value, ties by ascending id
    if top_k:
        order = order[:top_k]
    zs = z[order]
    keep = zs > -np.inf
    order, zs = order[keep], zs[keep]
    p = np.exp(zs - zs[0])  # [n] f64, p[0] = 1 (zs[0] is the max)
    p /= p.sum()
    if top_p < 1:
        cut = int(np.searchsorted(np.cumsum(p), top_p, side="left")) + 1
        order, p = order[:cut], p[:cut]
    cdf = np.cumsum(p)  # [n] f64
    u = uniform(seed, position) * cdf[-1]
    idx = min(int(np.searchsorted(cdf, u, side="right")), order.size - 1)
    return int(order[idx])


def greedy_rows(logits: np.ndarray) -> np.ndarray:
    """Every row's greedy pick of logits [B, V] in one call: row b's is bitwise :func:`sample`'s
    greedy draw from that row alone (its first maximum), or -1 where that first maximum is NaN or
    -inf (there :func:`sample`'s full path decides: NaN read as -inf, or its error). [B] i64."""
    rows = np.asarray(logits)
    if rows.ndim != 2 or rows.shape[1] == 0 or rows.dtype.kind != "f":
        return np.full(rows.shape[0] if rows.ndim else 0, -1, np.int64)  # [B] i64: none made
    if rows.shape[0] == 1:  # one stream's step: the same pick without the batch's index arrays
        first = int(rows[0].argmax())  # its first maximum (stops at a NaN, as sample's argmax)
        value = rows[0, first]
        return np.array([first if value == value and value != -np.inf else -1], np.int64)  # [1] i64
    best = np.argmax(rows, axis=1)  # [B] i64: each row's first maximum (stops at a NaN, as sample's argmax)
    top = rows[np.arange(rows.shape[0]), best]  # [B] the values picked
    picks: np.ndarray = np.where((top == top) & (top != -np.inf), best, -1).astype(np.int64)  # [B] i64
    return picks
