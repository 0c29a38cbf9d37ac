"""The HTTP service's speed, against real ``coli-kv serve --http`` processes on loopback.

    python -m bench.serve [--quick] [--json] [--dir DIR] [--tokens N] [--reps N] [--max-tokens N]

Every figure is a ratio to a baseline measured in this run, medians of ``--reps`` repetitions
(both sides alternated):

1. ``batch16_speedup`` (glm-mini): aggregate decode tokens/s of 16 clients streaming completions
   on 16 sessions at once / one session's decode tokens/s alone, same server (bench.serve_decode).
   No goal of its own (it is ``batch16_step_speedup`` x ``served_over_step16``). Read by a lean
   one-thread client (bench.serve_sse); beside it, in the same loop, ``batch16_speedup_httpx``, the
   same figure read by 16 httpx clients in 16 threads. ``batch16_step_speedup``: the same ratio for
   the engine's step alone in this process (16 caches vs one). Goal >= 8. ``served_over_step16``:
   the served aggregate at 16 sessions / the in-process step of 16's tokens/s. Goal >= 0.95.
   ``batch16_outside_step_s``: a round of 16 in the server minus the in-process step of 16, per
   session (the server's work per token outside the step).
2. ``stream_overhead_ratio`` (glm-mini): per-token latency of a streamed completion over HTTP /
   ``model.forward`` of one token in this process over a cache of the same length. Goal <= 1.10.
   ``stream_overhead_s``: the difference, in seconds. ``ttft16_over_ttft1`` (goal <= 3) and
   ``itl_max_during_long_prefill_over_median`` (goal <= 4): bench.serve_core.
3. ``resume_on_request_ratio``: a suspended GLM-5.2-shaped v2 session (32,768 tokens; ``--quick``
   2,048): (time to first token of a request on it - that request's one decode step, timed by the
   server's engine) / a raw sequential read of its kv file. Goal <= 1.5. The resume verifies as
   FORMAT.md 4.4 and 5.5 require (every record's checksum; the last position's recompute deferred
   since the request feeds a token and every record is vouched for). Also printed,
   ``resume_added_ratio`` = (TTFT - the same request's TTFT on the session while resident) / the
   read: what the resume adds, with the server's own step and HTTP in both terms
   (bench.serve_session).
4. ``http_migrate_vs_durable_copy``: that session's bundle streamed A -> B, B pulling it from A
   (``POST /v1/sessions/ID/pull``, B started with ``--pull-from`` A: B reads A's GET off the
   socket in its receiving thread) / one durable copy of its files (``cp -r`` + fsync). Goal >=
   0.8. Beside it ``http_migrate_pipe_vs_durable_copy``: a client piping A's GET into B's PUT.

5. ``batch16_speedup_glm52_layers`` (full runs, or ``--only glm52``): the step of 16 vs of one on
   GLM-5.2's real layer dims (bench.serve_core). Goal >= 12.

The GLM-5.2-shaped model is a random checkpoint with GLM-5.2's cache dims (78 layers, kv_lora
512, rope 64, vocab 154,880) and a 64-wide body (bench.session_build's decoder), written here.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import add_json_flag
from bench.serve_core import bench_long_prefill, bench_ttft, glm52_layers_speedup
from bench.serve_decode import CLIENTS, PROMPT, bench_batch, bench_stream, step_speedup
from bench.serve_migrate import FIGURE_KEYS, report_figure, run_figure
from bench.serve_procs import Server
from bench.serve_session import bench_migrate, bench_resume, build, write_glm_cache_checkpoint
from sessionstore.service.limits import ServiceLimits

GOALS = {"batch16_step_speedup": (">=", 8.0), "served_over_step16": (">=", 0.95), "stream_overhead_ratio": ("<=", 1.10),
         "ttft16_over_ttft1": ("<=", 3.0), "itl_max_during_long_prefill_over_median": ("<=", 4.0),
         "batch16_speedup_glm52_layers": (">=", 12.0), "resume_on_request_ratio": ("<=", 1.5),
         "http_migrate_vs_durable_copy": (">=", 0.8)}
KEYS = ("served_over_step16", "ttft16_over_ttft1", "ttft1_s", "ttft16_s", "ttft1_all", "ttft16_all",
        "itl_max_during_long_prefill_over_median", "itl_max_during_long_prefill_s", "itl_median_during_long_prefill_s",
        "long_prefill_ttft_s", "long_prompt_tokens", "itl_ratio_all", "max_prefill_tokens", "prefill_step_ratio",
        "batch16_speedup_glm52_layers", "glm52_step1_s", "glm52_step16_s", "glm52_experts", "glm52_weight_bytes",
        "batch16_speedup", "batch16_step_speedup", "step_solo_s", "step_batch16_s", "step_length",
        "batch16_share_of_step_speedup", "batch16_outside_step_s",
        "stream_overhead_s",
        "stream_overhead_ratio", "resume_on_request_ratio", "resume_added_ratio",
        "http_migrate_vs_durable_copy", "batch16_tokens_per_s", "single_tokens_per_s", "batch16_window_s",
        "batch16_window_tokens", "batch_max_tokens", "batch_clients", "batch16_speedup_httpx",
        "batch16_tokens_per_s_httpx", "single_tokens_per_s_httpx", "batch16_client_cpu_s", "batch16_client_cpu_s_httpx",
        "batch16_all", "single_all", "stream_per_token_s",
        "stream_median_gap_s", "in_process_step_s", "stream_max_tokens", "stream_mean_length", "ttft_s",
        "ttft_resident_s",
        "raw_read_s", "decode_step_s", "resident_step_s", "server_resume_s", "resume_rest_s", "resume_verified",
        "resume_check_beside_s", "resume_check_wait_s", "kv_bytes",
        "http_migrate_s", "http_migrate_pipe_vs_durable_copy", "http_migrate_pipe_s",
        "durable_copy_s",
        "session_bytes", "bundle_bytes", "http_migrate_gb_s", "durable_copy_gb_s", "tokens", "reps", "quick",
        "model_note", "elapsed_s")


def run_decode(root: Path, reps: int, max_tokens: int,
               max_prefill_tokens: int = ServiceLimits.max_prefill_tokens,
               prefill_step_ratio: int = ServiceLimits.prefill_step_ratio) -> dict[str, Any]:
    from kernels.model import load_model, resolve_model
    from kernels.model.text import load_text

    source = resolve_model("glm-mini")
    model = load_model(source)
    prompt = load_text(source).encode(PROMPT, add_special_tokens=True)
    resident = str(CLIENTS * (3 * reps + 1) + 6 * reps + 2)  # every session of the figures stays resident
    with Server(root / "mini", "glm-mini", "--max-resident", resident,
                "--max-prefill-tokens", str(max_prefill_tokens),
                "--prefill-step-ratio", str(prefill_step_ratio)) as server:
        res = bench_stream(server, model, prompt, max_tokens, reps, "fp8")
        res.update(bench_batch(server, prompt, max_tokens, reps))
        res.update(bench_ttft(server, prompt, reps))
        res.update(bench_long_prefill(server, prompt, reps))
    res.update(step_speedup(model, prompt, len(prompt) + max_tokens // 2, "fp8", 5 * reps))
    res.update(outside_the_step(res))
    res["served_over_step16"] = res["batch16_tokens_per_s"] * res["step_batch16_s"] / CLIENTS
    res["max_prefill_tokens"], res["prefill_step_ratio"] = max_prefill_tokens, prefill_step_ratio
    return res


def outside_the_step(res: dict[str, Any]) -> dict[str, float]:
    """What the server spends per token outside the engine's step, from this run's figures: one
    session's streamed token minus the in-process step; a round of 16 (16 / aggregate rate) minus
    the in-process step of 16, per session."""
    round_s = CLIENTS / res["batch16_tokens_per_s"]
    return {"stream_overhead_s": res["stream_per_token_s"] - res["in_process_step_s"],
            "batch16_outside_step_s": (round_s - res["step_batch16_s"]) / CLIENTS,
            "batch16_share_of_step_speedup": res["batch16_speedup"] / res["batch16_step_speedup"]}


def run_session(root: Path, n_tokens: int, reps: int, *, migrate: bool = True) -> dict[str, Any]:
    """Figures 3 and 4 on one GLM-5.2-shaped session (``migrate`` False: figure 3 alone)."""
    model_dir = write_glm_cache_checkpoint(root / "glm-5.2-shaped")
    s = build(root / "a", model_dir, n_tokens)
    kv_path, directory = s.kv_path, s.directory  # suspended (build_session): the server takes its lock
    with Server(root / "a", str(model_dir), log_json=True) as a:
        res = bench_resume(a, kv_path, reps)
        if migrate:
            with Server(root / "b", str(model_dir), "--pull-from", a.url) as b:
                res.update(bench_migrate(a, b, directory, root, reps))
    return res


def verdict(key: str, value: float) -> str:
    op, goal = GOALS[key]
    met = value <= goal if op == "<=" else value >= goal
    return f"{op} {goal} ({'met' if met else 'NOT met'})"


def report(res: dict[str, Any]) -> None:
    ms = 1e3
    print(f"bench.serve: {'QUICK (smaller session, fewer reps)' if res['quick'] else 'full'}; "
          f"{res['reps']} reps, medians; {res['elapsed_s']:.0f} s")
    print(f"  batch16_speedup        {res['batch16_speedup']:8.2f}x   {res['batch16_tokens_per_s']:.1f} tok/s over "
          f"{res['batch_clients']} sessions at once (window {res['batch16_window_s']:.1f} s, "
          f"{res['batch16_window_tokens']:.0f} tokens) vs {res['single_tokens_per_s']:.1f} tok/s alone; glm-mini, "
          f"{res['batch_max_tokens']} tokens each, decode only (no goal of its own: see served_over_step16)")
    print(f"    each rep: {res['batch16_all']} vs {res['single_all']} tok/s; client CPU "
          f"{res['batch16_client_cpu_s']:.2f} s per 16 streams; the same read by 16 httpx clients: "
          f"{res['batch16_speedup_httpx']:.2f}x ({res['batch16_tokens_per_s_httpx']:.0f} vs "
          f"{res['single_tokens_per_s_httpx']:.1f} tok/s, client CPU {res['batch16_client_cpu_s_httpx']:.2f} s)")
    print(f"  batch16_step_speedup   {res['batch16_step_speedup']:8.2f}x   the engine's step alone (in process, no "
          f"HTTP/sessions/files): {res['step_batch16_s'] * ms:.1f} ms for 16 vs {res['step_solo_s'] * ms:.2f} ms for "
          f"one, T={res['step_length']}; goal {verdict('batch16_step_speedup', res['batch16_step_speedup'])}")
    print(f"  served_over_step16     {res['served_over_step16']:8.3f}    served "
          f"{res['batch16_tokens_per_s']:.1f} tok/s at 16 sessions vs the in-process step of 16's "
          f"{CLIENTS / res['step_batch16_s']:.1f} tok/s; goal "
          f"{verdict('served_over_step16', res['served_over_step16'])}")
    print(f"    outside the step, per session per token in a round of 16: "
          f"{res['batch16_outside_step_s'] * ms:.3f} ms")
    print(f"  stream_overhead_ratio  {res['stream_overhead_ratio']:8.3f}    "
          f"{res['stream_per_token_s'] * ms:.2f} ms per streamed token (median gap "
          f"{res['stream_median_gap_s'] * ms:.2f} ms) vs model.forward "
          f"{res['in_process_step_s'] * ms:.2f} ms in-process at T={res['stream_mean_length']}; "
          f"goal {verdict('stream_overhead_ratio', res['stream_overhead_ratio'])}")
    print(f"    outside the step, per streamed token: {res['stream_overhead_s'] * ms:.3f} ms (1.10 allows "
          f"{0.10 * res['in_process_step_s'] * ms:.3f} ms)")
    print(f"  ttft16_over_ttft1      {res['ttft16_over_ttft1']:8.2f}    median TTFT of 16 new sessions at once "
          f"{res['ttft16_s'] * ms:.1f} ms vs one alone {res['ttft1_s'] * ms:.1f} ms (each rep: {res['ttft16_all']} vs "
          f"{res['ttft1_all']} ms); goal {verdict('ttft16_over_ttft1', res['ttft16_over_ttft1'])}")
    print(f"  itl_max_during_long_prefill_over_median {res['itl_max_during_long_prefill_over_median']:.2f}  "
          f"4 streams while a {res['long_prompt_tokens']}-token prompt is admitted "
          f"(at most {res['max_prefill_tokens']} prompt tokens a step, paced to {res['prefill_step_ratio']} decode "
          "steps): longest gap "
          f"{res['itl_max_during_long_prefill_s'] * ms:.1f} ms, median "
          f"{res['itl_median_during_long_prefill_s'] * ms:.2f} ms, the prompt's TTFT "
          f"{res['long_prefill_ttft_s'] * ms:.0f} ms (each rep: {res['itl_ratio_all']}); goal "
          f"{verdict('itl_max_during_long_prefill_over_median', res['itl_max_during_long_prefill_over_median'])}")
    if "batch16_speedup_glm52_layers" in res:
        print(f"  batch16_speedup_glm52_layers {res['batch16_speedup_glm52_layers']:.2f}x  step of 16 "
              f"{res['glm52_step16_s'] * ms:.0f} ms vs of one {res['glm52_step1_s'] * ms:.0f} ms, GLM-5.2 layer dims, "
              f"1 dense + 1 MoE layer with {res['glm52_experts']} routed experts (top-8), "
              f"{res['glm52_weight_bytes'] / 2**30:.1f} GiB of f32 weights; goal "
              f"{verdict('batch16_speedup_glm52_layers', res['batch16_speedup_glm52_layers'])}")
    if "ttft_s" in res:
        report_session(res)
    print(f"  model: {res['model_note']}")


def report_session(res: dict[str, Any]) -> None:
    ms = 1e3
    print(f"  resume_on_request_ratio{res['resume_on_request_ratio']:8.2f}    TTFT {res['ttft_s'] * ms:.0f} ms - one "
          f"decode step {res['decode_step_s'] * ms:.0f} ms (that request's, timed by the server) vs raw read "
          f"{res['raw_read_s'] * ms:.1f} ms of "
          f"{res['kv_bytes'] / 2**20:.0f} MiB ({res['tokens']} tokens, v2 fp8); goal "
          f"{verdict('resume_on_request_ratio', res['resume_on_request_ratio'])}")
    print(f"    the server's resume {res['server_resume_s'] * ms:.0f} ms of it (every record's checksum; the last "
          f"position: {', '.join(res['resume_verified'])}; FORMAT.md 4.4, 5.5); the same request on the resident "
          f"session {res['ttft_resident_s'] * ms:.0f} ms: the resume adds {res['resume_added_ratio']:.2f}x the read "
          f"(resume_added_ratio); the rest (HTTP, IPC, admission, the commit) {res['resume_rest_s'] * ms:.0f} ms")
    print(f"  http_migrate_vs_durable_copy {res['http_migrate_vs_durable_copy']:.3f}  B pulls from A over HTTP "
          f"{res['http_migrate_s'] * ms:.0f} ms ({res['http_migrate_gb_s']:.2f} GB/s, bundle "
          f"{res['bundle_bytes'] / 2**20:.0f} MiB) vs cp -r + fsync {res['durable_copy_s'] * ms:.0f} ms "
          f"({res['durable_copy_gb_s']:.2f} GB/s) of {res['session_bytes'] / 2**20:.0f} MiB; goal "
          f"{verdict('http_migrate_vs_durable_copy', res['http_migrate_vs_durable_copy'])}")
    print(f"    a client piping A's GET into B's PUT instead: {res['http_migrate_pipe_vs_durable_copy']:.3f} "
          f"({res['http_migrate_pipe_s'] * ms:.0f} ms)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 2,048-token session and fewer reps (~1-2 minutes)")
    add_json_flag(ap)
    ap.add_argument("--dir", default=None, help="where the stores go (a real disk)")
    ap.add_argument("--tokens", type=int, default=None, help="committed tokens of the GLM-5.2-shaped session")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each figure")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens each decode request streams")
    ap.add_argument("--only", choices=("migrate", "decode", "glm52", "resume"), default=None,
                    help="a part alone (migrate: figure 4; decode: the glm-mini figures; "
                         "glm52: the GLM-5.2-layer step; resume: figure 3)")
    ap.add_argument("--max-prefill-tokens", type=int, default=ServiceLimits.max_prefill_tokens,
                    help="the glm-mini server's prompt tokens per step beside running streams "
                         f"(default {ServiceLimits.max_prefill_tokens}, the server's)")
    ap.add_argument("--prefill-step-ratio", type=int, default=ServiceLimits.prefill_step_ratio,
                    help="the glm-mini server's --prefill-step-ratio (default "
                         f"{ServiceLimits.prefill_step_ratio}, the server's; 0: no pacing)")
    args = ap.parse_args(argv)
    tokens = args.tokens or (2048 if args.quick else 32768)
    reps = args.reps or (2 if args.quick else 5)
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    if tokens < 2 or reps < 1 or max_tokens < 2 or args.max_prefill_tokens < 1 or args.prefill_step_ratio < 0:
        ap.error("--tokens and --max-tokens must be >= 2, --reps and --max-prefill-tokens >= 1, "
                 "--prefill-step-ratio >= 0")
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="coli-bench-serve-", dir=args.dir))
    try:
        if args.only == "migrate":
            res: dict[str, Any] = run_figure(root, tokens, reps)
        elif args.only == "glm52":
            res = glm52_layers_speedup(max(3, reps))
        elif args.only == "resume":
            res = run_session(root, tokens, reps, migrate=False)
        else:
            res = run_decode(root, reps, max_tokens, args.max_prefill_tokens, args.prefill_step_ratio)
            if args.only != "decode":
                res.update(run_session(root, tokens, reps))
                if not args.quick:  # ~1-2 minutes and 5 GiB: full runs only (or --only glm52)
                    res.update(glm52_layers_speedup(max(3, reps)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.only == "glm52":
        print(f"bench.serve --only glm52: batch16_speedup_glm52_layers {res['batch16_speedup_glm52_layers']:.2f}x "
              f"(step of 16 {res['glm52_step16_s']:.3f} s vs of one {res['glm52_step1_s']:.3f} s, "
              f"{res['glm52_experts']} routed experts); goal "
              f"{verdict('batch16_speedup_glm52_layers', res['batch16_speedup_glm52_layers'])}")
        if args.json:
            print(json.dumps({k: res[k] for k in KEYS if k in res}, sort_keys=True))
        return 0
    if args.only == "resume":
        res.update(tokens=tokens, reps=reps, quick=args.quick, elapsed_s=time.perf_counter() - t0)
        print(f"bench.serve --only resume: {tokens} tokens, {reps} reps, medians; {res['elapsed_s']:.0f} s")
        print(f"  resume_on_request_ratio{res['resume_on_request_ratio']:8.2f}    TTFT {res['ttft_s'] * 1e3:.0f} ms - "
              f"one decode step {res['decode_step_s'] * 1e3:.0f} ms vs raw read {res['raw_read_s'] * 1e3:.1f} ms; the "
              f"server's resume {res['server_resume_s'] * 1e3:.0f} ms, the rest {res['resume_rest_s'] * 1e3:.0f} ms "
              f"(the checksum pass beside the step {res['resume_check_beside_s'] * 1e3:.0f} ms, waited for "
              f"{res['resume_check_wait_s'] * 1e3:.0f} ms); goal "
              f"{verdict('resume_on_request_ratio', res['resume_on_request_ratio'])}")
        if args.json:
            print(json.dumps({k: res[k] for k in KEYS if k in res}, sort_keys=True))
        return 0
    if args.only == "migrate":
        res.update(tokens=tokens, reps=reps, quick=args.quick, elapsed_s=time.perf_counter() - t0)
        print(f"bench.serve --only migrate: {tokens} tokens, {reps} reps, medians; {res['elapsed_s']:.0f} s")
        report_figure(res)
        if args.json:
            print(json.dumps({k: res[k] for k in (*FIGURE_KEYS, "tokens", "reps", "quick")}, sort_keys=True))
        return 0
    res.update(tokens=tokens, reps=reps, quick=args.quick, elapsed_s=time.perf_counter() - t0,
               model_note="glm-mini (shipped) for figures 1-2; for 3-4 a random checkpoint with GLM-5.2's cache "
               "dims (78 layers, kv_lora 512, rope 64, vocab 154880) and a 64-wide body")
    report(res)
    if args.json:
        print(json.dumps({k: res[k] for k in KEYS if k in res}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
