"""What ``serve --durable-stream`` costs: glm-mini, real server processes on loopback, the same
requests against a server without it (the baseline) and one with it, alternated rep by rep.

    python -m bench.durable_stream [--quick] [--json] [--dir DIR] [--reps N] [--max-tokens N]

- ``durable_stream_rate_ratio_8`` / ``_16``: aggregate decode tokens/s of 8 (16) clients
  streaming completions on as many new sessions at once, with the flag / without it (the window
  where every stream decodes, bench.serve_decode.aggregate_rate). Goal >= 0.85.
  ``durable_stream_rate_ratio_1``: the same of one stream alone (no goal of its own: whether a
  lone stream's steps wait on its commits' latency).
- ``itl_p50_s`` / ``itl_p99_s`` with and without it, at 8 and 16 streams: the gaps between two
  text events of a stream, over every stream of a rep (the median of the reps).
- ``cpu_per_token_ratio_8`` / ``_16``: the server's CPU seconds (its processes, every thread, from
  /proc) per token streamed, with the flag / without it: what it costs, less moved by other load
  on the machine than the rates are; ``cpu_ratio_all_*`` and ``ratio_all_*``: each rep's ratios.
- ``durable_each_rate_ratio_8`` / ``_16`` (and its ``itl_*`` / ``cpu_*`` keys, side ``each``): a third
  server with the flag whose tail commits each sync alone (``COLI_SHARED_BARRIER=0``: one fdatasync
  per session per step) instead of one barrier per step for every session (the default); left out
  with ``--no-each``.

Every request is greedy with ``ignore_eos`` and ``max_tokens`` long, so both servers send the same
bytes; the token ids of every stream are checked equal across the two. Each server's store lives
under ``--dir`` (default: the system's temp directory; give a real disk: the durable side
fdatasyncs there). Medians of ``--reps`` (default 9; ``--quick`` 3): on a machine whose other load
moves the rates rep by rep, more alternated reps are what steadies the medians.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from bench.report import add_json_flag, json_line
from bench.serve_decode import PROMPT, aggregate_rate, request
from bench.serve_procs import Server, Streamed
from bench.serve_sse import stream_all
from sessionstore.service.steps.loop import SHARED_BARRIER_ENV

GOAL = 0.85
WIDTHS = (1, 8, 16)  # 1: one stream alone (its rate waits on the commits if anything does)
SIDES = ("plain", "durable", "each")


def _gaps(streams: list[Streamed]) -> list[float]:
    return [g for s in streams for g in np.diff(s.text_times).tolist()]


def cpu_seconds(server: Server) -> float:
    """The server's CPU time so far (user + system, every thread) from /proc: its process and
    every process below it (the engine core runs in a process of its own)."""
    assert server.proc is not None
    total, todo = 0, [server.proc.pid]
    while todo:
        pid = todo.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:  # ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def one_rep(server: Server, prompt: list[int], width: int, max_tokens: int, tag: str) -> dict[str, Any]:
    """``width`` streams at once: aggregate tokens/s, every inter-token gap, every stream's ids,
    and the server's CPU seconds per token streamed."""
    bodies = [request(prompt, max_tokens, f"{tag}-{i}", server.model_id) for i in range(width)]
    cpu = cpu_seconds(server)
    streams = stream_all(server.url, bodies)
    cpu = cpu_seconds(server) - cpu
    rate, _, _ = aggregate_rate(streams)
    return {"rate": rate, "gaps": _gaps(streams), "ids": [s.tokens for s in streams],
            "cpu_per_token": cpu / sum(len(s.tokens) for s in streams)}


def _start(server: Server, env: dict[str, str]) -> None:
    with mock.patch.dict(os.environ, env):  # the server process inherits ``env``; ours is restored after
        server.start()


def run(root: Path, reps: int, max_tokens: int, sides: tuple[str, ...] = SIDES) -> dict[str, Any]:
    from kernels.model import resolve_model
    from kernels.model.text import load_text

    prompt = load_text(resolve_model("glm-mini")).encode(PROMPT, add_special_tokens=True)
    resident = str(sum(WIDTHS) * reps + 4)  # every session of the run stays resident
    flag = {"plain": "--no-durable-stream", "durable": "--durable-stream", "each": "--durable-stream"}
    servers = {side: Server(root / side, "glm-mini", "--max-resident", resident, flag[side]) for side in sides}
    rates: dict[tuple[str, int], list[float]] = {}
    p50: dict[tuple[str, int], list[float]] = {}
    p99: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    try:
        for side, server in servers.items():
            _start(server, {SHARED_BARRIER_ENV: "0" if side == "each" else "1"})
        for side, server in servers.items():  # warm-up: numba kernels compiled, files created once
            one_rep(server, prompt, 2, 8, f"warm-{side}")
        for rep in range(reps):
            for width in WIDTHS:
                ids: dict[str, list[list[int]]] = {}
                order = sides[rep % len(sides):] + sides[:rep % len(sides)]  # each side first in turn
                order = order if rep % 2 == 0 else order[::-1]
                for side in order:
                    got = one_rep(servers[side], prompt, width, max_tokens, f"r{rep}w{width}")
                    ids[side] = got["ids"]
                    rates.setdefault((side, width), []).append(got["rate"])
                    p50.setdefault((side, width), []).append(float(np.percentile(got["gaps"], 50)))
                    p99.setdefault((side, width), []).append(float(np.percentile(got["gaps"], 99)))
                    cpu.setdefault((side, width), []).append(got["cpu_per_token"])
                if any(ids[side] != ids["plain"] for side in sides):
                    raise RuntimeError("the two servers streamed different tokens: the figures compare nothing")
    finally:
        for server in servers.values():
            server.stop()
    res: dict[str, Any] = {}
    for width in WIDTHS:
        plain, durable = (statistics.median(rates[(side, width)]) for side in ("plain", "durable"))
        res[f"durable_stream_rate_ratio_{width}"] = durable / plain
        res[f"tokens_per_s_{width}_plain"], res[f"tokens_per_s_{width}_durable"] = plain, durable
        res[f"ratio_all_{width}"] = [round(d / p, 3) for p, d in zip(rates[("plain", width)],
                                                                       rates[("durable", width)], strict=True)]
        res[f"cpu_per_token_ratio_{width}"] = (statistics.median(cpu[("durable", width)])
                                               / statistics.median(cpu[("plain", width)]))
        res[f"cpu_ratio_all_{width}"] = [round(d / p, 3) for p, d in zip(cpu[("plain", width)],
                                                                         cpu[("durable", width)], strict=True)]
        if "each" in sides:
            res[f"tokens_per_s_{width}_each"] = statistics.median(rates[("each", width)])
            res[f"durable_each_rate_ratio_{width}"] = res[f"tokens_per_s_{width}_each"] / plain
            res[f"cpu_per_token_ratio_{width}_each"] = (statistics.median(cpu[("each", width)])
                                                        / statistics.median(cpu[("plain", width)]))
        for side in sides:
            res[f"cpu_per_token_s_{width}_{side}"] = statistics.median(cpu[(side, width)])
            res[f"itl_p50_s_{width}_{side}"] = statistics.median(p50[(side, width)])
            res[f"itl_p99_s_{width}_{side}"] = statistics.median(p99[(side, width)])
    return res


def report(res: dict[str, Any]) -> None:
    for width in WIDTHS:
        ratio = res[f"durable_stream_rate_ratio_{width}"]
        goal = "" if width == 1 else f"goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'}; "
        print(f"{width} streams: {res[f'tokens_per_s_{width}_durable']:.1f} tok/s durable vs "
              f"{res[f'tokens_per_s_{width}_plain']:.1f} plain: durable_stream_rate_ratio_{width} {ratio:.3f} "
              f"({goal}reps {res[f'ratio_all_{width}']})")
        print(f"  inter-token p50 {res[f'itl_p50_s_{width}_durable'] * 1e3:.1f} ms durable vs "
              f"{res[f'itl_p50_s_{width}_plain'] * 1e3:.1f} ms plain; p99 "
              f"{res[f'itl_p99_s_{width}_durable'] * 1e3:.1f} ms vs {res[f'itl_p99_s_{width}_plain'] * 1e3:.1f} ms")
        print(f"  server CPU per token {res[f'cpu_per_token_s_{width}_durable'] * 1e3:.2f} ms durable vs "
              f"{res[f'cpu_per_token_s_{width}_plain'] * 1e3:.2f} ms plain: "
              f"{res[f'cpu_per_token_ratio_{width}']:.3f}x (reps {res[f'cpu_ratio_all_{width}']})")
        if f"durable_each_rate_ratio_{width}" in res:
            each = {k: res[f"{k}_{width}_each"] * 1e3 for k in ("itl_p50_s", "itl_p99_s")}
            print(f"  one fdatasync per session instead of one barrier per step: "
                  f"{res[f'tokens_per_s_{width}_each']:.1f} tok/s, "
                  f"ratio {res[f'durable_each_rate_ratio_{width}']:.3f}; "
                  f"ITL p50 / p99 {each['itl_p50_s']:.1f} / {each['itl_p99_s']:.1f} ms; "
                  f"CPU per token {res[f'cpu_per_token_ratio_{width}_each']:.3f}x plain")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 reps of 32-token streams")
    add_json_flag(ap)
    ap.add_argument("--dir", default=None, help="where the two stores go (a real disk)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each figure (both sides each)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens each stream decodes")
    ap.add_argument("--no-each", action="store_true",
                    help="leave out the third server (durable, one fdatasync per session per step)")
    args = ap.parse_args(argv)
    reps = args.reps or (3 if args.quick else 9)
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    if reps < 1 or max_tokens < 4:
        ap.error("--reps must be >= 1 and --max-tokens >= 4")
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="coli-bench-durable-", dir=args.dir))
    try:
        res = run(root, reps, max_tokens, SIDES[:2] if args.no_each else SIDES)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res.update(reps=reps, max_tokens=max_tokens, quick=args.quick, elapsed_s=time.perf_counter() - t0)
    print(f"bench.durable_stream: glm-mini, {reps} reps of {max_tokens}-token streams, medians; "
          f"{res['elapsed_s']:.0f} s")
    report(res)
    return json_line(res, args.json, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
