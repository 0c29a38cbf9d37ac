"""The API process's Prometheus metrics: requests by outcome and what a client sees of each turn
(:class:`HttpMetrics`, :class:`TurnClock`: time to first token, the gaps between tokens, prompt and
cached tokens) and the engine process's restarts. ``GET /metrics`` renders them after the engine
core's (:class:`sessionstore.service.engine.metrics.EngineMetrics`, fetched from the core at each scrape)."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

# a first token can wait behind a long prefill or a queue
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class HttpMetrics:
    """The API process's: requests by outcome, time to first token and between tokens, prompt and
    cached tokens, and restarts of the engine process."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("coli_requests", "HTTP requests by endpoint and outcome (HTTP status)",
                                ["endpoint", "status"], registry=r)
        self.engine_restarts = Counter("coli_engine_restarts", "engine processes started again after one died",
                                       registry=r)
        self.first_token_seconds = Histogram(
            "coli_time_to_first_token_seconds", "from a turn's request to its first streamed text (or to its "
            "end when it gave tokens but no text)", registry=r, buckets=FIRST_TOKEN_BUCKETS)
        self.inter_token_seconds = Histogram(
            "coli_inter_token_latency_seconds", "between consecutive streamed pieces of a turn's text (a token "
            "each, unless the detokenizer or a stop string held text back)", registry=r, buckets=INTER_TOKEN_BUCKETS)
        self.prompt_tokens = Counter("coli_prompt_tokens", "prompt tokens of finished turns", registry=r)
        self.cached_tokens = Counter("coli_cached_prompt_tokens", "prompt tokens reused from a session's history "
                                     "(not computed again)", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TurnClock:
    """What one request's client sees of its turn, observed as the handler receives its events:
    the first text (time to first token, from ``start``), each later text (the gap since the one
    before), and the end (prompt and cached tokens)."""

    def __init__(self, metrics: HttpMetrics, start: float) -> None:
        self.metrics, self.start = metrics, start
        self.last: float | None = None  # when the last text came

    def text(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.first_token_seconds.observe(now - self.start)
        else:
            self.metrics.inter_token_seconds.observe(now - self.last)
        self.last = now

    def done(self, generated: int, prompt_tokens: int, cached_tokens: int) -> None:
        if self.last is None and generated:  # tokens but no text (token ids only, or held back)
            self.metrics.first_token_seconds.observe(time.perf_counter() - self.start)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.cached_tokens.inc(cached_tokens)


__all__ = ["FIRST_TOKEN_BUCKETS", "INTER_TOKEN_BUCKETS", "HttpMetrics", "TurnClock"]
