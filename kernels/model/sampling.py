"""Token sampling with no hidden state: the draw for a position depends only on (seed, position, logits).

Greedy (temperature 0) takes the first maximum. Otherwise the logits are divided by the
temperature, sorted (descending value, ties by ascending id), cut to ``top_k`` and then to the
smallest prefix whose probability reaches ``top_p``; one uniform number u in [0, 1) derived by
hashing (seed, position) with splitmix64 picks the token by inverse CDF over that prefix. A
resumed session therefore samples exactly what an uninterrupted one would.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kernels.errors import FormatError

_MASK64 = (1 << 64) - 1


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
    0 means greedy; ``top_k`` 0 and ``top_p`` 1 disable the cuts."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

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

    @classmethod
    def checked(cls, temperature: Any, top_k: Any, top_p: Any, seed: Any) -> Sampler:
        """Settings from values as given (a flag, a request body, a file): checked by the rules
        above as given (FormatError names the bad one), then stored as float temperature / top_p
        and int top_k / seed."""
        cls(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)  # checks the values as given
        return cls(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=int(seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits: np.ndarray, position: int) -> int:
        return sample(logits, seed=self.seed, position=position, temperature=self.temperature,
                      top_k=self.top_k, top_p=self.top_p)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sampler:
        return cls(**{k: d[k] for k in ("temperature", "top_k", "top_p", "seed") if k in d})


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
