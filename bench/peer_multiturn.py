"""bench.peer's multi-turn workload, driven by NVIDIA's ``aiperf`` (the bench extra): 16 conversations
of 4 turns (200 new prompt tokens a turn on top of the history, 64 output tokens, streamed chat,
the conversation named in the ``X-Session-Id`` header, the glm-mini tokenizer), concurrency 16,
against each server in turn. Keys: ``peer_multiturn_tok_s_ratio`` (output tokens/s),
``peer_multiturn_ttft_ratio`` (mean time to first token), ``peer_multiturn_itl_ratio`` (mean
inter-token latency), ours / llama.cpp; ``peer_multiturn_cpu_ratio``: the CPU seconds (user + system)
each server's processes spent over the run, ours (the API process and the engine core) / llama.cpp's:
the work each does for the same workload, which a loaded machine's waits do not enter (on 2 cores
shared with the client, a server whose work is a third less can be at most ~1.5x as fast). Each side's
figures also hold ``busy_s``, the window aiperf timed (first request sent to last reply received;
where its export lacks the times, the window in which the server's CPU grew), and ``client_cpu_s``,
aiperf's own CPU in that window (both process trees read every 0.2 s): where the client's CPU and the server's fill
the machine's cores, the run cannot be shorter than their sum over the cores, whatever the server does.
``peer_multiturn_server_budget_s`` puts that in seconds: the CPU our server could spend if its output
tokens/s were ``GOAL`` x llama.cpp's, the client keeping the rate of CPU it spent beside ours (it is a
rate, not a fixed cost: measured beside both servers, aiperf's CPU grows with the run's length).

aiperf runs as a command (``aiperf`` beside this interpreter, on PATH, or ``$COLI_AIPERF``): its
dependencies need not share the project's environment. Where it is missing or fails, the result
says why in one line (``multiturn_skipped``) and the rest of the bench stands."""
from __future__ import annotations

import bisect
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.peer_servers import Side

CONVERSATIONS, TURNS, CONCURRENCY, NEW_TOKENS, OUTPUT_TOKENS = 16, 4, 16, 200, 64
GOAL = 3.0  # issue 36's multi-turn output tokens/s goal, ours / llama.cpp
METRICS = {"tok_s": "output_token_throughput", "ttft_ms": "time_to_first_token", "itl_ms": "inter_token_latency"}


def find_aiperf() -> str | None:
    """The aiperf command: ``$COLI_AIPERF``, beside this interpreter, or on PATH."""
    beside = Path(sys.executable).with_name("aiperf")
    for candidate in (os.environ.get("COLI_AIPERF"), str(beside) if beside.exists() else None, shutil.which("aiperf")):
        if candidate:
            return candidate
    return None


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) that process ``pid`` and every live descendant have used (Linux
    ``/proc``; a process that is gone counts 0)."""
    tick, total, todo = os.sysconf("SC_CLK_TCK"), 0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total / tick


def aiperf_command(aiperf: str, url: str, model_name: str, tokenizer: Path, out: Path,
                   conversations: int = CONVERSATIONS) -> list[str]:
    """One aiperf profile run of the workload against ``url``."""
    return [aiperf, "profile", "--model", model_name, "--url", url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(tokenizer), "--conversation-num", str(conversations),
            "--conversation-turn-mean", str(TURNS), "--conversation-turn-stddev", "0",
            "--isl", str(NEW_TOKENS), "--isl-stddev", "0", "--osl", str(OUTPUT_TOKENS), "--osl-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--session-header", "X-Session-Id",
            "--concurrency", str(CONCURRENCY), "--artifact-dir", str(out), "--ui-type", "none",
            "--no-server-metrics", "--random-seed", "36"]


def read_metrics(export: Path) -> dict[str, float]:
    """Output tokens/s, mean TTFT and mean inter-token latency (ms) from aiperf's JSON export, and
    how many requests failed."""
    data = json.loads(export.read_text())
    records = data.get("records", data)
    out = {name: float(records[key]["avg"]) for name, key in METRICS.items()}
    errors = data.get("error_summary") or []
    out["errors"] = float(sum(int(e.get("count", 0)) for e in errors if isinstance(e, dict)))
    out["requests"] = float(records.get("request_count", {}).get("avg", 0))
    return out


def multiturn_keys(ours: dict[str, float], theirs: dict[str, float]) -> dict[str, Any]:
    """The three keys (ours / llama.cpp), the CPU one where both sides' CPU was read, and both
    sides' figures."""
    keys = {"peer_multiturn_tok_s_ratio": ours["tok_s"] / theirs["tok_s"],
            "peer_multiturn_ttft_ratio": ours["ttft_ms"] / theirs["ttft_ms"],
            "peer_multiturn_itl_ratio": ours["itl_ms"] / theirs["itl_ms"]}
    if ours.get("server_cpu_s") and theirs.get("server_cpu_s"):
        keys["peer_multiturn_cpu_ratio"] = ours["server_cpu_s"] / theirs["server_cpu_s"]
    if ours.get("busy_s") and ours.get("client_cpu_s") is not None:
        keys["peer_multiturn_server_budget_s"] = server_budget_s(ours, theirs["tok_s"], os.cpu_count() or 1)
    return {**keys, "multiturn": {"ours": ours, "llama_cpp": theirs}}


def server_budget_s(ours: dict[str, float], their_tok_s: float, cores: int) -> float:
    """The CPU seconds our server could spend were its output tokens/s ``GOAL`` x ``their_tok_s``: the
    same tokens in ``busy_s * tok_s / (GOAL * their_tok_s)`` seconds, on ``cores`` cores less the client's
    rate of CPU (``client_cpu_s / busy_s``, as it ran beside ours)."""
    window = ours["busy_s"] * ours["tok_s"] / (GOAL * their_tok_s)
    return max(cores - ours["client_cpu_s"] / ours["busy_s"], 0.0) * window


def sample_run(cmd: list[str], server_pid: int | None, log: Path, period: float = 0.2,
               timeout: float = 1800.0) -> tuple[int, list[tuple[float, float, float]]]:
    """Run ``cmd`` (its output to ``log``), reading every ``period`` s the server's and the command's
    process trees' CPU: (its exit status, [(seconds since start, server CPU s, client CPU s)])."""
    samples: list[tuple[float, float, float]] = []
    with open(log, "w") as out:
        client = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        start, client_cpu = time.monotonic(), 0.0
        try:
            while True:
                done = client.poll() is not None
                client_cpu = max(client_cpu, tree_cpu_s(client.pid))  # its exit takes its tree: keep the last
                samples.append((time.monotonic() - start, tree_cpu_s(server_pid) if server_pid else 0.0, client_cpu))
                if done:
                    return client.returncode, samples
                if time.monotonic() - start > timeout:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                time.sleep(period)
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()


def busy_window(samples: list[tuple[float, float, float]], threshold: float = 0.02) -> dict[str, float]:
    """From :func:`sample_run`'s samples, the window in which the server worked (from the sample before
    its CPU first grew by more than ``threshold`` s to the last sample where it grew): its length
    ``busy_s`` and the client's CPU in it, ``client_cpu_s`` (on a machine whose cores the server and
    the client share, the run takes at least (server + client CPU) / cores). Without server figures:
    the whole run."""
    grew = [i for i in range(1, len(samples)) if samples[i][1] - samples[i - 1][1] > threshold]
    first, last = (grew[0] - 1, grew[-1]) if grew else (0, len(samples) - 1)
    return {"busy_s": samples[last][0] - samples[first][0], "client_cpu_s": samples[last][2] - samples[first][2]}


def aiperf_window(samples: list[tuple[float, float, float]], started: float,
                  export: dict[str, Any]) -> dict[str, float] | None:
    """The window aiperf itself timed (its export's ``start_time`` .. ``end_time``: first request sent
    to last reply received, this machine's local time) in :func:`sample_run`'s samples, begun at
    ``started`` (epoch seconds): its length ``busy_s`` and the client's CPU in it ``client_cpu_s``, each
    tree's CPU read between samples by linear interpolation. None when the export has no such times or
    they fall outside the samples. Unlike :func:`busy_window` it is not stretched by work the server
    does after the last reply (a session released, a sweep) while aiperf writes its reports."""
    try:
        begin = datetime.fromisoformat(str(export["start_time"])).timestamp() - started
        end = datetime.fromisoformat(str(export["end_time"])).timestamp() - started
    except (KeyError, TypeError, ValueError):
        return None
    times = [t for t, _, _ in samples]
    if not samples or not 0.0 <= begin < end <= times[-1]:
        return None

    def at(column: int, t: float) -> float:  # the tree's CPU at t, between the samples around it
        i = max(1, min(bisect.bisect_left(times, t), len(samples) - 1))
        (t0, *v0), (t1, *v1) = samples[i - 1], samples[i]
        a, b = v0[column], v1[column]
        return a if t1 == t0 else a + (b - a) * (t - t0) / (t1 - t0)

    return {"busy_s": end - begin, "client_cpu_s": at(1, end) - at(1, begin)}


def run_one(aiperf: str, side: Side, model: Path, out: Path, conversations: int) -> dict[str, float]:
    cmd = aiperf_command(aiperf, side.url, side.model_name, model, out, conversations)
    pid: int | None = getattr(side, "pid", None)  # the server's process (a fake side in the tests has none)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"  # aiperf's output, beside its artifact folder (which it makes)
    started = time.time()  # the samples' second 0 (aiperf's window is in wall-clock time)
    status, samples = sample_run(cmd, pid, log)
    exports = sorted(out.rglob("profile_export_aiperf.json"))
    if status != 0 or not exports:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        raise RuntimeError(f"aiperf against {side.name} exited {status}: {lines[-1][:200] if lines else ''}")
    window = aiperf_window(samples, started, json.loads(exports[-1].read_text())) or busy_window(samples)
    figures = {**read_metrics(exports[-1]), **window}
    if pid:
        figures["server_cpu_s"] = samples[-1][1] - samples[0][1]  # its tree's CPU over the whole run
    return figures


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the reps (errors and requests: their sums)."""
    return {k: (sum if k in ("errors", "requests") else statistics.median)([r[k] for r in runs]) for k in runs[0]}


def multiturn(start: dict[str, Callable[[], Side]], model: Path, scratch: Path, reps: int = 1,
              warm: Callable[[Side], None] | None = None) -> dict[str, Any]:
    """The workload against each side, ``reps`` times, alternating which goes first (ours in the
    first), each side started fresh and (with ``warm``) warmed before it is timed; the keys of the
    medians, or ``multiturn_skipped`` saying why not."""
    aiperf = find_aiperf()
    if aiperf is None:
        return {"multiturn_skipped": "no aiperf command (pip install -e '.[bench]', or set COLI_AIPERF)"}
    figures: dict[str, list[dict[str, float]]] = {"ours": [], "llama.cpp": []}
    try:
        for rep in range(reps):
            for name in (["ours", "llama.cpp"] if rep % 2 == 0 else ["llama.cpp", "ours"]):
                side = start[name]()
                try:
                    if warm is not None:
                        warm(side)
                    figures[name].append(run_one(aiperf, side, model, scratch / f"aiperf-{name}-{rep}", CONVERSATIONS))
                finally:
                    side.stop()
    except (RuntimeError, OSError, KeyError, ValueError, subprocess.TimeoutExpired) as exc:
        return {"multiturn_skipped": str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}
    keys = multiturn_keys(medians(figures["ours"]), medians(figures["llama.cpp"]))
    keys["multiturn"]["reps"] = {"ours": figures["ours"], "llama_cpp": figures["llama.cpp"]}
    return keys


__all__ = ["aiperf_command", "aiperf_window", "busy_window", "find_aiperf", "medians", "multiturn", "multiturn_keys",
           "read_metrics", "sample_run", "tree_cpu_s"]
