"""The tiers' metrics (FORMAT.md 7): offloads, restores, expiries, and bytes per tier."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge


class TierMetrics:
    """Offloads, restores, expiries (counters) and bytes per tier (gauges read at scrape time)."""

    def __init__(self, registry: Any) -> None:
        self.offloads = Counter("coli_tier_offloads", "sessions offloaded to the object store (local files removed)",
                                registry=registry)
        self.restores = Counter("coli_tier_restores", "offloaded sessions restored from the object store",
                                registry=registry)
        self.expiries = Counter("coli_tier_expiries", "sessions deleted past their retention_seconds",
                                registry=registry)
        self.bytes = Gauge("coli_tier_bytes", "bytes per tier: resident (KV in memory), local (session files on this "
                           "disk), object_store (kv bytes of sessions offloaded from here)", ["tier"],
                           registry=registry)

    def bind(self, resident: Callable[[], int], by_state: Callable[[], dict[str, int]]) -> None:
        self.bytes.labels(tier="resident").set_function(resident)
        self.bytes.labels(tier="local").set_function(
            lambda: sum(v for k, v in by_state().items() if k in ("resident", "suspended")))
        self.bytes.labels(tier="object_store").set_function(lambda: by_state().get("offloaded", 0))


__all__ = ["TierMetrics"]
