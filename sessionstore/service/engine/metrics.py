"""The engine core's Prometheus metrics (:class:`EngineMetrics`): its forwards, commits, resumes,
sessions and how many turns wait for it or run in it, rendered in the core and fetched by the API
process at each scrape. ``GET /metrics`` is these, then the API process's own
(:mod:`sessionstore.service.http.metrics`)."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

PROMPT_SOURCES = ("stored_kv", "computed")  # coli_prompt_tokens_served's source label
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# a turn can run for many minutes
TURN_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class FunctionCounter(Collector):
    """A counter whose value a function reads at scrape time (``name`` exposed as ``name_total``)."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name, self.documentation = name, documentation
        self.read: Callable[[], float] = lambda: 0

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, value=self.read())


class EngineMetrics:
    """The engine core's: generated tokens, turns waiting and running, sessions and their resident
    bytes, evictions, commit / resume / turn latency, decode steps and their batch sizes, group
    commits in flight."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tokens = Counter("coli_tokens_generated", "tokens sampled by the engine", registry=r)
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
        self.steps = FunctionCounter("coli_decode_steps", "batched decode steps the engine thread ran")
        r.register(self.steps)
        self.batch_size = Histogram("coli_decode_batch_size", "sessions advanced together by one decode step",
                                    registry=r, buckets=BATCH_BUCKETS)
        self.forward_seconds = Histogram("coli_forward_seconds", "the engine thread's forwards: batched decode steps "
                                         "and prefills", ["kind"], registry=r, buckets=LATENCY_BUCKETS)
        self.turn_seconds = Histogram("coli_turn_seconds", "one turn in the engine, prompt to commit", registry=r,
                                      buckets=TURN_BUCKETS)
        self.waiting = Gauge("coli_requests_waiting", "turns accepted and waiting for the engine", registry=r)
        self.running = Gauge("coli_requests_running", "turns the engine is running", registry=r)
        self.commits_in_flight = Gauge("coli_commits_in_flight", "sessions whose group commit runs beside the "
                                       "engine's steps (started at the end of a pass, not yet waited for)",
                                       registry=r)
        self.fenced = Gauge("coli_sessions_fenced", "sessions fenced after a commit failed with an I/O error "
                            "(nothing more written; reopened from their last verified commit on their next request)",
                            registry=r)
        self.records_refused = Counter(
            "coli_records_refused", "records of sessions' kv files refused by their checksums (the sidecar's, "
            "checked before a session's rows are used: a resume that found them damaged fails, nothing is served "
            "from them)", registry=r)
        self.prompt_tokens_served = Counter(
            "coli_prompt_tokens_served", "prompt tokens of the engine's turns (every choice) by where their KV came "
            "from: source=stored_kv, the session's stored rows reused; source=computed, a forward computed them",
            ["source"], registry=r)
        # each labelled series looked up once, not at every step or turn (labels() builds a key each call)
        self._served = {source: self.prompt_tokens_served.labels(source=source) for source in PROMPT_SOURCES}
        self._forwards = {kind: self.forward_seconds.labels(kind=kind) for kind in ("step", "prefill")}
        self.fences = Counter("coli_session_fences", "sessions fenced after a failed commit (EIO from fsync, ...)",
                              registry=r)

    def bind_sessions(self, resident: Callable[[], int], suspended: Callable[[], int],
                      resident_bytes: Callable[[], int], steps: Callable[[], int],
                      commits_in_flight: Callable[[], int]) -> None:
        """Gauges (and the steps counter) read at scrape time."""
        self.steps.read = steps
        self.commits_in_flight.set_function(commits_in_flight)
        self.resident.set_function(resident)
        self.suspended.set_function(suspended)
        self.resident_bytes.set_function(resident_bytes)

    def observe_forward(self, kind: str, sessions: int, seconds: float) -> None:
        """One forward of the engine thread: ``kind`` "step" (``sessions`` advanced by one token
        each) or "prefill" (one session's prompt)."""
        series = self._forwards.get(kind)
        (series if series is not None else self.forward_seconds.labels(kind=kind)).observe(seconds)
        if kind == "step":
            self.batch_size.observe(sessions)

    def observe_prompt(self, prompt_tokens: int, reused: int) -> None:
        """One turn's prompt: ``reused`` of its ``prompt_tokens`` served from the session's stored KV,
        the rest computed."""
        self._served["stored_kv"].inc(reused)
        self._served["computed"].inc(max(prompt_tokens - reused, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["BATCH_BUCKETS", "LATENCY_BUCKETS", "PROMPT_SOURCES", "TURN_BUCKETS", "EngineMetrics", "FunctionCounter"]
