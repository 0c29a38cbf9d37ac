"""The service's Prometheus metrics (``GET /metrics``), in a registry of their own."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServiceMetrics:
    """Tokens, requests by outcome, sessions and their resident bytes, commit / resume latency."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tokens = Counter("coli_tokens_generated", "tokens sampled by the engine", registry=r)
        self.requests = Counter("coli_requests", "HTTP requests by endpoint and outcome (HTTP status)",
                                ["endpoint", "status"], registry=r)
        self.evictions = Counter("coli_sessions_evicted", "idle sessions suspended by the residency limits",
                                 registry=r)
        self.resident = Gauge("coli_sessions_resident", "sessions resident (lock held, rows mapped)", registry=r)
        self.suspended = Gauge("coli_sessions_suspended", "committed sessions not resident", registry=r)
        self.resident_bytes = Gauge("coli_resident_kv_bytes", "mapped + owned KV bytes of resident sessions",
                                    registry=r)
        self.commit_seconds = Histogram("coli_commit_seconds", "the last commit of each turn", registry=r,
                                        buckets=LATENCY_BUCKETS)
        self.resume_seconds = Histogram("coli_resume_seconds", "resume of a suspended session on request",
                                        registry=r, buckets=LATENCY_BUCKETS)
        self.steps = Gauge("coli_decode_steps", "batched decode steps the engine thread ran", registry=r)
        self.batch_size = Histogram("coli_decode_batch_size", "sessions advanced together by one decode step",
                                    registry=r, buckets=BATCH_BUCKETS)
        self.forward_seconds = Histogram("coli_forward_seconds", "the engine thread's forwards: batched decode steps "
                                         "and prefills", ["kind"], registry=r, buckets=LATENCY_BUCKETS)
        self.turn_seconds = Histogram("coli_turn_seconds", "one turn in the engine, prompt to commit", registry=r,
                                      buckets=LATENCY_BUCKETS)

    def bind_sessions(self, resident: Callable[[], int], suspended: Callable[[], int],
                      resident_bytes: Callable[[], int], steps: Callable[[], int]) -> None:
        """Gauges read at scrape time."""
        self.steps.set_function(steps)
        self.resident.set_function(resident)
        self.suspended.set_function(suspended)
        self.resident_bytes.set_function(resident_bytes)

    def observe_forward(self, kind: str, sessions: int, seconds: float) -> None:
        """One forward of the engine thread: ``kind`` "step" (``sessions`` advanced by one token
        each) or "prefill" (one session's prompt)."""
        self.forward_seconds.labels(kind=kind).observe(seconds)
        if kind == "step":
            self.batch_size.observe(sessions)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["BATCH_BUCKETS", "LATENCY_BUCKETS", "ServiceMetrics"]
