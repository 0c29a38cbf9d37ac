"""Where glm-mini's compiled step spends its time, by kernel: the step of ``--rows`` sessions (fp8 caches
of 40-55 tokens, as bench.step_rows) run for ``--seconds`` under ``perf record`` (cpu-clock samples of
this process), numba's code named through a perf map (bench/jit_symbols.py). Prints each kernel's
share of the window's samples (the Python interpreter's symbols summed as ``python``), and the thread
CPU per step. Needs Linux ``perf``; where it is missing or refused, one line says why (exit 2).

    python -m bench.step_profile --json
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import jit_symbols

jit_symbols.install()  # before any kernel loads: numba keeps no object code otherwise

import numba  # noqa: E402
import numpy as np  # noqa: E402

from bench.report import figures  # noqa: E402
from bench.step_rows import decode_sessions  # noqa: E402
from kernels.model import DecoderCache, MLADecoder, load_model, resolve_model  # noqa: E402

_LINE = re.compile(r"^\s*([\d.]+)%\s+(\S.*?)\s+\[[.k]\]\s+(.+?)\s*$")


def _glm52(rows: int) -> tuple[MLADecoder, list[DecoderCache]]:
    """bench.step_glm52's two layers at GLM-5.2's dims (8 routed experts, ~7.8 GiB) and its sessions."""
    from bench import step_glm52  # only this case imports the big checkpoint's builder

    model = step_glm52.build_model(8)
    return model, step_glm52.sessions(model, rows)


def _run(model: MLADecoder, caches: list[DecoderCache], seconds: float, prompt: int = 0) -> float:
    """Steps of every cache for ``seconds`` (truncated back every 8 steps; ``prompt``: one chunk of
    that many tokens of the first cache a step instead, truncated back each time): thread CPU ms per step."""
    lengths = [c.length for c in caches]
    tokens = np.arange(len(caches), dtype=np.int32)  # [n] i32
    chunk = (np.arange(prompt, dtype=np.int32) * 7) % 3072  # [prompt] i32
    start, cpu, steps = time.monotonic(), time.thread_time(), 0
    while time.monotonic() - start < seconds:
        for _ in range(1 if prompt else 8):
            if prompt:
                model.step(caches[:1], chunk, [prompt])
            else:
                model.step(caches, tokens, [1] * len(caches))
            steps += 1
        for c, n in zip(caches, lengths, strict=True):
            c.truncate(n)
    return (time.thread_time() - cpu) / steps * 1e3


def shares(report: str, top: int) -> list[tuple[str, float]]:
    """``perf report --stdio --sort dso,sym`` lines -> the ``top`` (name, percent) by share: numba's
    symbols by name, the interpreter's summed as ``python``, others as ``dso:symbol``."""
    summed: dict[str, float] = {}
    for line in report.splitlines():
        found = _LINE.match(line)
        if not found:
            continue
        pct, dso, sym = float(found.group(1)), found.group(2), found.group(3)
        name = "python" if "libpython" in dso else sym if dso.startswith("[JIT]") else f"{dso}:{sym}"
        summed[name] = summed.get(name, 0.0) + pct
    return sorted(summed.items(), key=lambda kv: -kv[1])[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--rows", type=int, default=16, help="sessions in the step (default 16)")
    parser.add_argument("--seconds", type=float, default=8.0, help="the profiled window (default 8)")
    parser.add_argument("--top", type=int, default=15, help="kernels listed (default 15)")
    parser.add_argument("--glm52", action="store_true",
                        help="bench.step_glm52's layers at GLM-5.2's dims (one numba thread), not glm-mini")
    parser.add_argument("--prompt", type=int, default=0,
                        help="profile a prompt: one session's chunk of this many tokens a step (default: decode rows)")
    args = parser.parse_args(argv)
    perf = shutil.which("perf")
    if perf is None:
        print("bench.step_profile: Linux perf is not installed (apt install linux-perf)", file=sys.stderr)
        return 2
    rows = 1 if args.prompt else args.rows
    if args.glm52:
        numba.set_num_threads(1)
        model, caches = _glm52(rows)
    else:
        model = load_model(resolve_model("glm-mini"))
        caches = decode_sessions(model, rows)
    _run(model, caches, 1.0, args.prompt)  # warm: compiled code, layouts, scratch
    named = jit_symbols.write_perf_map()
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "perf.data"
        rec = subprocess.Popen([perf, "record", "-e", "cpu-clock", "-F", "999", "-p", str(os.getpid()), "-o",
                                str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)  # perf attaches
        if rec.poll() is not None:
            _, err = rec.communicate()
            why = (err.decode().strip().splitlines() or ["no message"])[-1]
            print(f"bench.step_profile: perf record failed: {why}", file=sys.stderr)
            return 2
        ms = _run(model, caches, args.seconds, args.prompt)
        rec.send_signal(signal.SIGINT)
        rec.wait(timeout=30)
        report = subprocess.run([perf, "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso,sym"],
                                capture_output=True, text=True, check=False).stdout
    top = shares(report, args.top)
    result = {"step_profile_model": "glm52" if args.glm52 else "glm-mini", "step_profile_rows": args.rows,
              "step_profile_prompt": args.prompt, "step_profile_ms": round(ms, 3), "step_profile_symbols": named,
              "step_profile_top": [[name, round(pct, 2)] for name, pct in top]}
    if args.json:
        return figures(result, True)
    what = f"a prompt chunk of {args.prompt} tokens" if args.prompt else f"a step of {args.rows} rows"
    model_name = "GLM-5.2 dims" if args.glm52 else "glm-mini"
    print(f"{model_name}, {what}: {ms:.3f} ms thread CPU; {named} compiled functions named")
    for name, pct in top:
        print(f"  {pct:6.2f}%  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
