"""What a large session's checksum pass costs the OTHER streams of the same server.

    python -m bench.resume_stall [--tokens N] [--reps N] [--base DIR] [--json]

A GLM-5.2-shaped v2 session of ``--tokens`` committed tokens (default 32,768: 1.49 GB of 45.5 KB
records, bench.session_build) is suspended in a store; a server (``coli-kv serve --http``) runs one
stream on another session ("run", ``STREAM_TOKENS`` tokens) and, once that stream has
``AFTER_TOKENS`` events, one of these on the big session:

- ``resume``: a streamed completion continuing it (the request's resume: its checksum pass);
- ``fork``: ``POST /v1/sessions/glm/fork`` (a copy checked record by record), the copy deleted after;
- ``bundle``: ``GET /v1/sessions/glm/bundle`` read to the end (an export, checked before it leaves).

Figures per action: the running stream's longest gap between two events, its median gap, and their
ratio (medians over the reps), with a control (no action) beside them. With ``--base DIR`` (a
checkout of another tree, e.g. ``git -C /work/main archive main | tar -x -C DIR``) the same is run
against that tree's server too, the two servers alternated rep by rep, and ratios printed
(this tree / base). The session is suspended again before each action.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serve_procs import REPO, Server
from bench.serve_session import SESSION, build, continue_prompt, write_bf16_safetensors
from bench.session_build import SEED, glm_cache_model
from kernels.model.config import parse_config
from kernels.model.tiny import tiny_weights

STREAM_TOKENS = 1000  # the running stream's tokens (long enough to outlast each action)
AFTER_TOKENS = 40  # events of the running stream before the action starts
ACTIONS = ("control", "resume", "fork", "bundle")
MINI = REPO / "models" / "glm-mini"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_checkpoint(directory: Path) -> Path:
    """bench.session_build's GLM-5.2-cache-shaped decoder (45,556 B records) with glm-mini's
    tokenizer and vocabulary (3,072 ids; a record's size does not depend on it), so that every
    sampled token is a text event of the stream (without a tokenizer the text comes in one piece)."""
    _, cfg = glm_cache_model()
    mini = json.loads((MINI / "config.json").read_text())
    cfg = {**cfg, "vocab_size": mini["vocab_size"], "bos_token_id": mini["bos_token_id"], "eos_token_id": 0}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copyfile(MINI / name, directory / name)
    write_bf16_safetensors(directory / "model.safetensors", tiny_weights(parse_config(cfg, source="bench"), SEED))
    return directory


def stream_times(client: httpx.Client, url: str, body: dict[str, Any], times: list[float] | None = None) -> list[float]:
    """POST a streamed ``/v1/completions``; the arrival time of each ``data:`` event, appended to
    ``times`` as they come (a new list by default)."""
    times = [] if times is None else times
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"completion: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.perf_counter())
                if line == "data: [DONE]":
                    break
    return times


def act(server: Server, action: str, rep: int) -> None:
    """One action on the big session (see the module doc)."""
    with httpx.Client(timeout=600) as client:
        if action == "resume":
            prompt, _ = continue_prompt(server)
            body = {"model": server.model_id, "prompt": prompt, "max_tokens": 1, "ignore_eos": True,
                    "temperature": 0, "session": SESSION}
            stream_times(client, server.url, body)
        elif action == "fork":
            server.call("POST", f"/v1/sessions/{SESSION}/fork", json={"new": f"copy{rep}"})
            server.call("DELETE", f"/v1/sessions/copy{rep}")
        elif action == "bundle":
            with client.stream("GET", f"{server.url}/v1/sessions/{SESSION}/bundle") as r:
                if r.status_code != 200:
                    raise RuntimeError(f"bundle: {r.status_code}")
                for _ in r.iter_raw(1 << 20):
                    pass


def one(server: Server, action: str, rep: int) -> dict[str, float]:
    """The running stream's (longest gap, median gap) while ``action`` ran; the action's seconds."""
    if action in ("resume", "fork", "bundle"):
        server.call("POST", f"/v1/sessions/{SESSION}/suspend")
    body = {"model": server.model_id, "prompt": [5, 6, 7], "max_tokens": STREAM_TOKENS, "ignore_eos": True,
            "temperature": 0, "session": f"run{rep}"}
    times: list[float] = []
    took: dict[str, float] = {}

    def run() -> None:
        with httpx.Client(timeout=600) as client:
            stream_times(client, server.url, body, times)

    thread = threading.Thread(target=run)
    thread.start()
    while len(times) < AFTER_TOKENS and thread.is_alive():
        time.sleep(0.002)
    t0 = time.perf_counter()
    if action != "control":
        act(server, action, rep)
    t1 = time.perf_counter()
    thread.join()
    server.call("DELETE", f"/v1/sessions/run{rep}")
    if t1 > times[-1]:
        raise RuntimeError(f"{action} outlasted the running stream ({len(times)} events over "
                           f"{times[-1] - times[0]:.3f} s): raise STREAM_TOKENS")
    gaps = [b - a for a, b in zip(times[1:-2], times[2:-1], strict=True)]  # first token and the end excluded
    took = {"max_gap_s": max(gaps), "median_gap_s": statistics.median(gaps), "action_s": t1 - t0}
    return took


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    return {"max_gap_ms": statistics.median(r["max_gap_s"] for r in runs) * 1e3,
            "median_gap_ms": statistics.median(r["median_gap_s"] for r in runs) * 1e3,
            "ratio": statistics.median(r["max_gap_s"] / r["median_gap_s"] for r in runs),
            "action_ms": statistics.median(r["action_s"] for r in runs) * 1e3,
            "max_gap_all_ms": [round(r["max_gap_s"] * 1e3, 1) for r in runs]}  # type: ignore[dict-item]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3, help="server starts per tree (each runs every action once)")
    ap.add_argument("--base", type=Path, default=None, help="a checkout of the tree to compare with")
    ap.add_argument("--dir", type=Path, default=None, help="where the store is built (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trees = {"this": REPO} if args.base is None else {"base": args.base.resolve(), "this": REPO}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        model_dir = write_checkpoint(root / "glm-5.2-shaped")
        build(root / "store", model_dir, args.tokens)
        raw: dict[str, dict[str, list[dict[str, float]]]] = {t: {a: [] for a in ACTIONS} for t in trees}
        for rep in range(args.reps):
            for name, repo in trees.items():  # alternated: base, this, base, this, ...
                with Server(root / "store", str(model_dir), log_json=True, repo=repo) as server:
                    stream_times(httpx.Client(timeout=600), server.url,  # warm: the kernels compile
                                 {"model": server.model_id, "prompt": [5, 6], "max_tokens": 4, "session": "warm"})
                    for action in ACTIONS:
                        raw[name][action].append(one(server, action, rep))
    res: dict[str, Any] = {"tokens": args.tokens, "reps": args.reps, "load": os.getloadavg()}
    for name in trees:
        res[name] = {a: summary(raw[name][a]) for a in ACTIONS}
    if args.base is not None:
        res["max_gap_ratio_this_over_base"] = {a: res["this"][a]["max_gap_ms"] / res["base"][a]["max_gap_ms"]
                                              for a in ACTIONS}
    if args.json:
        print(json.dumps(res, indent=1))
        return
    for name in trees:
        for a in ACTIONS:
            s = res[name][a]
            print(f"{name:5s} {a:8s} max gap {s['max_gap_ms']:7.1f} ms  median {s['median_gap_ms']:6.2f} ms  "
                  f"ratio {s['ratio']:6.1f}  action {s['action_ms']:7.0f} ms  all {s['max_gap_all_ms']}")
    if args.base is not None:
        print("max gap this/base:", {a: round(v, 2) for a, v in res["max_gap_ratio_this_over_base"].items()})
    print("load", res["load"])


if __name__ == "__main__":
    main()
