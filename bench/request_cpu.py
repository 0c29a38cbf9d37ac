"""The CPU one request costs each of the server's two processes: a tree against a baseline tree, alternated.

    python -m bench.request_cpu --baseline DIR [--json] [--reps N] [--requests N] [--streams N]

``coli-kv serve --http`` on glm-mini (fp8, the default), started fresh for each rep from the tree
measured (this checkout, or ``--baseline``: another checkout, e.g. ``git archive main | tar -x -C
DIR``; its first start compiles its numba cache), warmed by 10 streams, then driven by
:func:`bench.peer_client.stream_one` (bench.peer's client, one request at a time):

- ``--requests`` lone stateless requests, a 7-token prompt (as bench.peer's), ``max_tokens`` 1:
  the API process's and the engine core's CPU time per request (``/proc/PID/stat``, user + system,
  over the whole batch) and the client's median time to first token;
- ``--streams`` such requests of 128 greedy tokens: each process's CPU per stream and the median
  tokens/s.

The CPU per request is what a loaded machine moves least (it does not count the time a process
waits for a core), so it is the figure to compare on a shared 2-vCPU machine where bench.peer's
times move by 2x from run to run. Ratios are this tree's medians over the baseline's (< 1: less).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.report import figures

HERE = Path(__file__).resolve().parents[1]
PROMPT = [11, 22, 33, 44, 55, 66]  # after a first id that differs per request: 7 tokens


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(requests: int, streams: int) -> dict[str, Any]:
    """One rep in this process, over the tree this file's ``bench`` and the server import from."""
    from bench.peer_client import stream_one
    from bench.serve_procs import Server

    tree = Path(os.environ.get("PYTHONPATH", str(HERE)).split(os.pathsep)[0])
    root = Path(tempfile.mkdtemp(prefix="request-cpu-"))
    server = Server(root, str(tree / "models" / "glm-mini"), "--kv", "fp8", repo=tree).start()
    try:
        assert server.proc is not None
        api = server.proc.pid
        core = int(subprocess.run(["pgrep", "-P", str(api)], capture_output=True, text=True,
                                  check=True).stdout.split()[0])

        def body(i: int, max_tokens: int) -> dict[str, Any]:
            return {"model": server.model_id, "prompt": [100 + i % 50, *PROMPT], "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True, "temperature": 0}

        for i in range(10):
            stream_one(server.url, body(i, 16))
        out: dict[str, Any] = {}
        for name, n, max_tokens in (("request", requests, 1), ("stream", streams, 128)):
            a0, c0 = cpu_seconds(api), cpu_seconds(core)
            replies = [stream_one(server.url, body(i, max_tokens)) for i in range(n)]
            a1, c1 = cpu_seconds(api), cpu_seconds(core)
            out[f"{name}_api_cpu_ms"] = (a1 - a0) / n * 1e3
            out[f"{name}_core_cpu_ms"] = (c1 - c0) / n * 1e3
            out[f"{name}_ttft_ms"] = statistics.median(r.ttft for r in replies) * 1e3
            out[f"{name}_tok_s"] = statistics.median(r.tok_s for r in replies)
        out["load_1min"] = os.getloadavg()[0]
        return out
    finally:
        server.stop()


def _rep(tree: Path, requests: int, streams: int) -> dict[str, Any]:
    # this file run as a script: its own folder first on the path, then the tree measured (whose bench
    # modules, the client and the server's launcher, it imports: a baseline need not hold this file)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, __file__, "--rep", str(requests), str(streams)],
                          env=env, capture_output=True, text=True, check=False, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"request_cpu: the rep over {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


KEYS = ("request_api_cpu_ms", "request_core_cpu_ms", "request_ttft_ms", "stream_api_cpu_ms", "stream_core_cpu_ms",
        "stream_tok_s")


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--rep"]:  # one rep, in the tree's own process
        print(json.dumps(measure(int(sys.argv[2]), int(sys.argv[3]))))
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.request_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="the tree to compare against (a checkout of main)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=300, help="lone 1-token requests a rep")
    ap.add_argument("--streams", type=int, default=30, help="lone 128-token streams a rep")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    base = Path(args.baseline).resolve()
    if not (base / "sessionstore").is_dir() or not (base / "models" / "glm-mini").is_dir():
        print(f"request_cpu: {base} holds no sessionstore tree with models/glm-mini", file=sys.stderr)
        return 2
    sides: dict[str, list[dict[str, Any]]] = {"baseline": [], "this": []}
    for _ in range(args.reps):
        for side, tree in (("baseline", base), ("this", HERE)):
            sides[side].append(_rep(tree, args.requests, args.streams))
    medians = {side: {k: statistics.median(rep[k] for rep in reps) for k in KEYS} for side, reps in sides.items()}
    result: dict[str, Any] = {f"{k}{'_baseline' if side == 'baseline' else ''}": round(v, 3)
                              for side, values in medians.items() for k, v in values.items()}
    result.update({f"{k.removesuffix('_ms')}_ratio": round(medians["this"][k] / medians["baseline"][k], 3)
                   for k in KEYS})
    result["load_1min"] = [round(rep["load_1min"], 2) for reps in sides.values() for rep in reps]
    result["reps"] = {side: [{k: round(rep[k], 3) for k in KEYS} for rep in reps] for side, reps in sides.items()}
    return figures(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
