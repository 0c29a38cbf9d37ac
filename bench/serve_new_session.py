"""A new session's time to first token on ``coli-kv serve --http`` (issue 36 part 3), glm-mini,
a 7-token prompt, one streamed ``/v1/completions`` token, greedy; medians over alternated reps.

- ``new_session_ttft_s``: a request naming a session that does not exist yet (the server creates
  it: its kv file, sidecar, manifest and catalogue row are made on the engine's I/O threads while
  the prompt is prefilled and the first token drawn; the turn's commit waits for them).
- ``stateless_ttft_s``: the same request with no session (nothing stored), on the same server,
  alternated with the first; ``new_session_over_stateless``: the ratio, what a new session's
  files still add to its first token (1.0: nothing).
- with ``--baseline DIR`` (a checkout of the code before, e.g. the main branch): the same new-session
  request on a server running that code, alternated rep by rep with ours:
  ``new_session_ttft_baseline_s`` and ``new_session_ttft_ratio`` (ours / baseline's).

Each server first answers one untimed request (its kernels compile on the first step). Run as
``python -m bench.serve_new_session --json [--baseline /work/main] [--dir DIR]``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.report import add_json_flag
from bench.serve_procs import REPO, Server, stream_completion

MODEL = REPO / "models" / "glm-mini"
PROMPT = [3, 17, 95, 204, 11, 42, 7]  # 7 token ids, fed as they are
KEYS = ("new_session_ttft_s", "stateless_ttft_s", "new_session_over_stateless", "new_session_ttft_baseline_s",
        "new_session_ttft_ratio", "reps")


def ttft(client: httpx.Client, server: Server, session: str | None) -> float:
    """Seconds from the request's send to its first streamed event (one token, greedy)."""
    body: dict[str, Any] = {"model": server.model_id, "prompt": PROMPT, "max_tokens": 1, "ignore_eos": True,
                            "temperature": 0}
    if session is not None:
        body["session"] = session
    s = stream_completion(client, server.url, body)
    return s.first_event - s.sent


def measure(ours: Server, baseline: Server | None, reps: int) -> dict[str, Any]:
    """Alternated reps: a new session on ours, a stateless request on ours, a new session on the
    baseline's; medians and ratios."""
    new, stateless, base = [], [], []
    with httpx.Client(timeout=600) as client:
        for server in (ours, baseline):
            if server is not None:
                ttft(client, server, "warm")
        for i in range(reps):
            new.append(ttft(client, ours, f"n{i}"))
            stateless.append(ttft(client, ours, None))
            if baseline is not None:
                base.append(ttft(client, baseline, f"n{i}"))
    res: dict[str, Any] = {"new_session_ttft_s": statistics.median(new),
                           "stateless_ttft_s": statistics.median(stateless),
                           "new_session_over_stateless": statistics.median(
                               [a / b for a, b in zip(new, stateless, strict=True)]), "reps": reps,
                           "new_all": new, "stateless_all": stateless}
    if base:
        res.update(new_session_ttft_baseline_s=statistics.median(base), baseline_all=base,
                   new_session_ttft_ratio=statistics.median([a / b for a, b in zip(new, base, strict=True)]))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15, help="repetitions (alternated)")
    ap.add_argument("--baseline", default=None, help="a checkout of the code to compare with (its server alternates "
                    "with ours)")
    ap.add_argument("--dir", default=None, help="where the stores go (a real disk: their fsyncs are measured)")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    baseline_repo = Path(args.baseline).resolve() if args.baseline else None
    if baseline_repo is not None and not (baseline_repo / "sessionstore").is_dir():
        ap.error(f"--baseline {args.baseline}: not a checkout of this project (no sessionstore/)")
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="coli-bench-new-session-", dir=args.dir))
    try:
        with Server(root / "ours", str(MODEL)) as ours:
            if baseline_repo is None:
                res = measure(ours, None, args.reps)
            else:
                with Server(root / "base", str(MODEL), repo=baseline_repo) as base:
                    res = measure(ours, base, args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ms = 1e3
    print(f"bench.serve_new_session: glm-mini, a {len(PROMPT)}-token prompt, {args.reps} alternated reps, medians; "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"  new_session_ttft_s          {res['new_session_ttft_s'] * ms:7.2f} ms  (stateless "
          f"{res['stateless_ttft_s'] * ms:.2f} ms; new_session_over_stateless {res['new_session_over_stateless']:.2f})")
    if "new_session_ttft_ratio" in res:
        print(f"  new_session_ttft_baseline_s {res['new_session_ttft_baseline_s'] * ms:7.2f} ms  ({baseline_repo}); "
              f"new_session_ttft_ratio (ours / baseline) {res['new_session_ttft_ratio']:.2f}")
    if args.json:
        print(json.dumps({k: res[k] for k in KEYS if k in res}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
