"""The tier policy (FORMAT.md 5.10): which sessions to expire and which to offload, given their
sizes, last uses, retentions and pins. Pure: no files, no clock, no store; the service's tier
manager (:mod:`sessionstore.service.engine.tiers`) feeds it the catalogue's rows and acts on its plan.

Rules:

- a session expires once ``now >= last_use + retention_seconds``, unless it is pinned or busy
  (work in flight on it, or the turn being made room for);
- the local disk holds the kv files of every session that is not offloaded; with a budget, the
  least recently used idle local sessions (not pinned, not busy; ties by id) are offloaded, in that
  order, until the local bytes plus what is ``needed`` fit it. Sessions that expire now free their
  bytes first. A plan that cannot fit says so (``fits`` False): the caller refuses the turn (507).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class SessionUse:
    """What the policy reads of one session."""

    id: str
    bytes: int  # on this disk, or (offloaded) what its return would take
    last_use: float  # seconds since the epoch
    retention_s: int | None = None
    pinned: bool = False
    offloaded: bool = False
    busy: bool = False  # work in flight on it (never offloaded or expired now)


@dataclass(frozen=True)
class TierPlan:
    """What to do: ``expire`` and ``offload`` in order; ``local_bytes`` once done; whether the
    local bytes plus the need then fit the budget (always True without one)."""

    expire: tuple[str, ...]
    offload: tuple[str, ...]
    local_bytes: int
    fits: bool


def expired(use: SessionUse, now: float) -> bool:
    """Whether ``use`` is past its retention at ``now`` (never when pinned or busy)."""
    return (use.retention_s is not None and not use.pinned and not use.busy
            and now >= use.last_use + use.retention_s)


def plan_tiers(uses: Iterable[SessionUse], *, now: float, budget: int | None = None, needed: int = 0,
               can_offload: bool = True) -> TierPlan:
    """The plan for ``uses`` at ``now``: sessions past their retention expire; with ``budget``
    bytes, least recently used idle local sessions are offloaded (when ``can_offload``) until
    the local bytes plus ``needed`` fit."""
    if needed < 0:
        raise ValueError(f"needed {needed} < 0")
    uses = list(uses)
    expire = tuple(u.id for u in uses if expired(u, now))
    gone = set(expire)
    local = [u for u in uses if not u.offloaded and u.id not in gone]
    local_bytes = sum(u.bytes for u in local)
    offload: list[str] = []
    if budget is not None and can_offload and local_bytes + needed > budget:
        for u in sorted((u for u in local if not u.pinned and not u.busy), key=lambda u: (u.last_use, u.id)):
            if local_bytes + needed <= budget:
                break
            offload.append(u.id)
            local_bytes -= u.bytes
    fits = budget is None or local_bytes + needed <= budget
    return TierPlan(expire, tuple(offload), local_bytes, fits)


def epoch_of(iso: str) -> float:
    """Seconds since the epoch of an ISO-8601 UTC time as the manifest writes it (``...Z``);
    0.0 (the oldest) for an empty or unreadable one."""
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


__all__ = ["SessionUse", "TierPlan", "epoch_of", "expired", "plan_tiers"]
