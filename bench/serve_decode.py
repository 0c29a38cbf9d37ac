"""bench/serve.py's decode figures on glm-mini, over HTTP against one real server process:

- ``batch16_speedup``: aggregate decode tokens/s of 16 clients, each streaming a completion on its
  own session at once, over one session's decode tokens/s alone (same server, same request).
  Prefill is excluded: a stream's decode time runs from its first text event to its last; the
  aggregate counts the text events of all streams inside the window where all 16 are decoding
  (from the last stream's first event to the first stream's last event). Both rates are read by
  the lean client (bench.serve_sse: one thread, raw sockets, events parsed after the streams
  end), so the client takes little of the two cores the server decodes on; beside them, in the
  same loop, ``batch16_speedup_httpx`` is the same figure read by 16 httpx clients in 16 threads
  (about 0.45 of a core of client CPU while the 16 stream), with each client's CPU seconds.
- ``stream_overhead_ratio``: a streamed completion's per-token latency (first to last text event,
  per token in between) over ``model.forward`` of one token in this process, on a cache of the
  same model and kv dtype at the stream's mean length.

Every request is ``max_tokens`` long with ``ignore_eos``, greedy, so every stream decodes the
same number of tokens; a stream whose text events are not one per token is refused (the figures
count text events as tokens).
"""
from __future__ import annotations

import functools
import os
import statistics
import threading
import time
from typing import Any

import httpx
import numpy as np

from bench.serve_procs import Server, Streamed, stream_completion
from bench.serve_sse import stream_all

PROMPT = "The os module provides a portable way of using operating system dependent functionality."
CLIENTS = 16


def decode_span(s: Streamed) -> tuple[int, float]:
    """(decode tokens, seconds) of one stream: from its first text event to its last. Where every
    event arrived in one read (a short, fast stream: no span between them), from the request's
    sending to its last event, every token counted: the prefill inside makes that a lower bound
    of the rate, never a division by zero."""
    n = len(s.tokens)
    if len(s.text_times) != n:
        raise RuntimeError(f"a stream of {n} tokens sent {len(s.text_times)} text events: the timing "
                           "needs one per token")
    span = s.text_times[-1] - s.text_times[0]
    if span > 0:
        return n - 1, span
    return n, s.text_times[-1] - s.sent


def request(prompt: list[int], max_tokens: int, session: str, model: str) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "session": session}


def one_session(server: Server, body: dict[str, Any]) -> Streamed:
    with httpx.Client(timeout=600) as client:
        return stream_completion(client, server.url, body)


def concurrent(server: Server, bodies: list[dict[str, Any]]) -> list[Streamed]:
    """All ``bodies`` streamed at once, one client thread each (started together)."""
    results: list[Streamed | None] = [None] * len(bodies)
    errors: list[BaseException] = []
    gate = threading.Barrier(len(bodies))

    def run(i: int) -> None:
        try:
            with httpx.Client(timeout=600) as client:
                client.get(server.url + "/healthz")  # connected before the start
                gate.wait()
                results[i] = stream_completion(client, server.url, bodies[i])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def aggregate_rate(streams: list[Streamed]) -> tuple[float, float, int]:
    """(decode tokens/s, window seconds, tokens in it) while every stream is decoding; when the
    streams never overlap (a server that runs one turn at a time), every decode token over the
    span from the first stream's first event to the last one's last event."""
    for s in streams:
        decode_span(s)  # one text event per token, or refused
    t0 = max(s.text_times[0] for s in streams)
    t1 = min(s.text_times[-1] for s in streams)
    if t1 > t0:
        n = sum(sum(1 for t in s.text_times if t0 < t <= t1) for s in streams)
        return n / (t1 - t0), t1 - t0, n
    n = sum(len(s.text_times) - 1 for s in streams)
    span = max(s.text_times[-1] for s in streams) - min(s.text_times[0] for s in streams)
    return n / span, span, n


def _client_cpu(fn: Any) -> tuple[Any, float]:
    """``fn()`` and the CPU seconds this process spent meanwhile (the client's share of the cores)."""
    before = sum(os.times()[:2])
    out = fn()
    return out, sum(os.times()[:2]) - before


def bench_batch(server: Server, prompt: list[int], max_tokens: int, reps: int) -> dict[str, Any]:
    """Single-session decode rate and the 16-client aggregate, alternated, medians of ``reps``:
    read by the lean client, and by httpx clients in the same loop."""
    rates: dict[str, list[float]] = {}
    windows: list[tuple[float, int]] = []
    client_cpu: dict[str, list[float]] = {"lean": [], "httpx": []}
    for rep in range(reps):
        for client in ("lean", "httpx"):
            tag = f"{client[0]}{rep}"
            one_body = request(prompt, max_tokens, f"one-{tag}", server.model_id)
            alone = stream_all(server.url, [one_body])[0] if client == "lean" else one_session(server, one_body)
            n, secs = decode_span(alone)
            rates.setdefault(f"single_{client}", []).append(n / secs)
            bodies = [request(prompt, max_tokens, f"b{tag}-{i}", server.model_id) for i in range(CLIENTS)]
            read = stream_all if client == "lean" else lambda url, b: concurrent(server, b)
            streams, cpu = _client_cpu(functools.partial(read, server.url, bodies))
            rate, window, counted = aggregate_rate(streams)
            rates.setdefault(f"many_{client}", []).append(rate)
            client_cpu[client].append(cpu)
            if client == "lean":
                windows.append((window, counted))
    med = {k: statistics.median(v) for k, v in rates.items()}
    one, many = med["single_lean"], med["many_lean"]
    return {"batch16_speedup": many / one, "batch16_tokens_per_s": many, "single_tokens_per_s": one,
            "batch16_window_s": statistics.median(w for w, _ in windows),
            "batch16_window_tokens": statistics.median(c for _, c in windows),
            "batch_max_tokens": max_tokens, "batch_clients": CLIENTS,
            "batch16_speedup_httpx": med["many_httpx"] / med["single_httpx"],
            "batch16_tokens_per_s_httpx": med["many_httpx"], "single_tokens_per_s_httpx": med["single_httpx"],
            "batch16_client_cpu_s": statistics.median(client_cpu["lean"]),
            "batch16_client_cpu_s_httpx": statistics.median(client_cpu["httpx"]),
            "batch16_all": [round(x, 1) for x in rates["many_lean"]],
            "single_all": [round(x, 1) for x in rates["single_lean"]]}


def in_process_step(model: Any, prompt: list[int], length: int, kv_dtype: str, reps: int) -> float:
    """Median seconds of ``model.forward`` on one token over a ``kv_dtype`` cache of ``length``."""
    cache = model.new_cache(kv_dtype)
    ids = np.asarray(prompt, dtype=np.int32)  # [P] i32
    model.forward(ids[:-1], cache)
    logits = model.forward(ids[-1:], cache)[-1]  # [vocab] f32
    while cache.length < length:
        logits = model.forward(np.asarray([int(np.argmax(logits))], dtype=np.int32), cache)[-1]
    token = np.asarray([int(np.argmax(logits))], dtype=np.int32)  # [1] i32
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.forward(token, cache)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def steps_of_one_and_all(model: Any, caches: list[Any], length: int, reps: int) -> tuple[float, float]:
    """Median seconds of ``decode_step`` of the first cache alone and of all of them, alternated,
    every cache cut back to ``length`` after each (the same positions every time)."""
    tokens = np.full(len(caches), 5, dtype=np.int32)  # [B] i32
    one, many = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.decode_step(caches[:1], tokens[:1])
        one.append(time.perf_counter() - t0)
        caches[0].truncate(length)
        t0 = time.perf_counter()
        model.decode_step(caches, tokens)
        many.append(time.perf_counter() - t0)
        for cache in caches:
            cache.truncate(length)
    return statistics.median(one), statistics.median(many)


def step_speedup(model: Any, prompt: list[int], length: int, kv_dtype: str, reps: int) -> dict[str, Any]:
    """The engine's own share of ``batch16_speedup``, in this process: ``decode_step`` of 16 caches
    at ``length`` against 16 steps of one, alternated, medians (no HTTP, no sessions, no files)."""
    caches = []
    for i in range(CLIENTS):
        cache = model.new_cache(kv_dtype)
        ids = [int(t) for t in prompt] + [(i * 7 + j) % 200 + 3 for j in range(max(0, length - len(prompt)))]
        model.forward(np.asarray(ids[:length], dtype=np.int32), cache)
        caches.append(cache)
    solo, batch = steps_of_one_and_all(model, caches, length, reps)
    return {"batch16_step_speedup": CLIENTS * solo / batch, "step_solo_s": solo, "step_batch16_s": batch,
            "step_length": length}


def bench_stream(server: Server, model: Any, prompt: list[int], max_tokens: int, reps: int,
                 kv_dtype: str) -> dict[str, Any]:
    """Per-token latency of a streamed completion vs the in-process decode step (same lengths),
    alternated rep by rep so that both sides see the same machine."""
    per_token, gaps, steps = [], [], []
    mean_length = len(prompt) + max_tokens // 2
    for rep in range(reps):
        s = one_session(server, request(prompt, max_tokens, f"stream-{rep}", server.model_id))
        n, secs = decode_span(s)
        per_token.append(secs / n)
        gaps.append(statistics.median(np.diff(s.text_times).tolist()))
        steps.append(in_process_step(model, prompt, mean_length, kv_dtype, 5))
    ours, step = statistics.median(per_token), statistics.median(steps)
    return {"stream_overhead_ratio": ours / step, "stream_per_token_s": ours,
            "stream_median_gap_s": statistics.median(gaps), "in_process_step_s": step,
            "stream_max_tokens": max_tokens, "stream_mean_length": mean_length}


__all__ = ["CLIENTS", "PROMPT", "aggregate_rate", "bench_batch", "bench_stream", "decode_span",
           "in_process_step", "step_speedup"]
