"""The engine loop's own Python per pass of 16 running turns: a tree against a baseline tree, alternated.

    python -m bench.loop_pass --baseline DIR [--json] [--reps N] [--streams N] [--max-tokens N]

glm-mini (fp8 cache), ``--streams`` stateless greedy turns started together on one
:class:`~sessionstore.service.steps.loop.EngineLoop`, each through ``run_turn`` with an
:class:`~sessionstore.sessions.OutputProcessor` that detokenises (the server's per-token work on the
loop: the draw, the text, the stop strings, the sink). The loop thread's CPU time
(``time.thread_time``) of each pass, less the CPU time of its ``model.step``, over the passes whose
step held every stream as one single-token row: ``loop_python_us_per_pass`` (median of the passes,
then of the reps). Each rep runs in a process of its own, with ``PYTHONPATH`` the tree measured
(this checkout, or ``--baseline``: another checkout, e.g. ``git archive main | tar -x -C DIR``),
the two alternated rep by rep; ``loop_python_ratio`` is this tree's over the baseline's (< 1: less
Python a pass). The tokens of every stream are checked equal across the two trees.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]


def measure(streams: int, max_tokens: int) -> dict[str, Any]:
    """One rep in this process (over whatever tree ``sessionstore`` imports from)."""
    import numpy as np

    from kernels.model import Sampler, load_model, resolve_model
    from kernels.model.text import load_text
    from sessionstore.service.steps.loop import EngineLoop
    from sessionstore.sessions import OutputProcessor, TurnStop, turn_loop

    # a turn's mechanics over a cache: decode_turn (run_turn before the one run_turn took the name)
    decode_turn: Any = getattr(turn_loop, "decode_turn", None) or getattr(turn_loop, "run_turn")  # noqa: B009

    model: Any = load_model("glm-mini")
    tok = load_text(resolve_model("glm-mini"))
    steps: list[tuple[int, float]] = []  # (rows, thread CPU seconds) of each step
    inner = model.step

    def step(caches: list[Any], tokens: np.ndarray, counts: list[int]) -> np.ndarray:
        t0 = time.thread_time()
        out: np.ndarray = inner(caches, tokens, counts)
        rows = len(caches) if max(counts) == 1 else -1
        steps.append((rows, time.thread_time() - t0))
        return out

    model.step = step
    loop = EngineLoop(model, gather_s=0.2)
    marks: list[tuple[float, int]] = []  # (CPU clock, steps so far) at each pass's end
    loop.after_pass = lambda: marks.append((time.thread_time(), len(steps)))
    prompts = [tok.encode(f"Stream {i} tells a short story about the sea and the wind.", add_special_tokens=True)
               for i in range(streams)]
    out: dict[int, list[int]] = {}

    def turn(i: int) -> None:
        cache = model.new_cache("fp8")
        pieces: list[str] = []
        output = OutputProcessor(tokenizer=tok, on_text=pieces.append)
        try:
            decode_turn(model, cache, prompts[i], None, max_tokens, Sampler(),
                     on_step=lambda token, position, _logits: output.on_token(token, position),
                     drive=loop.drive_decode)
        except TurnStop:
            pass
        output.finish()
        out[i] = output.tokens

    futures = [loop.submit(functools.partial(turn, i)) for i in range(streams)]
    for fut in futures:
        fut.result(600)
    loop.stop()
    per_pass = []
    for (c0, n0), (c1, n1) in zip(marks, marks[1:], strict=False):
        if n1 == n0 + 1 and steps[n1 - 1][0] == streams:  # one step of every stream, single-token rows
            per_pass.append((c1 - c0 - steps[n1 - 1][1]) * 1e6)
    return {"loop_python_us_per_pass": statistics.median(per_pass), "passes": len(per_pass),
            "tokens": [out[i] for i in range(streams)]}


def _rep(tree: Path, streams: int, max_tokens: int) -> dict[str, Any]:
    # this file run as a script: its own folder first on the path, then the tree measured
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, __file__, "--rep", str(streams), str(max_tokens)], env=env,
                          capture_output=True, text=True, check=False, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"loop_pass: the rep over {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.loop_pass", description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="the tree to compare against (a checkout of main)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    base = Path(args.baseline).resolve()
    if not (base / "sessionstore").is_dir():
        print(f"loop_pass: {base} holds no sessionstore tree", file=sys.stderr)
        return 2
    sides: dict[str, list[float]] = {"baseline": [], "this": []}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.reps):
        for side, tree in (("baseline", base), ("this", HERE)):
            rep = _rep(tree, args.streams, args.max_tokens)
            sides[side].append(rep["loop_python_us_per_pass"])
            tokens.setdefault(side, rep["tokens"])
    medians = {side: statistics.median(values) for side, values in sides.items()}
    result = {"loop_python_us_per_pass_baseline": round(medians["baseline"], 1),
              "loop_python_us_per_pass": round(medians["this"], 1),
              "loop_python_ratio": round(medians["this"] / medians["baseline"], 3),
              "reps": {side: [round(v, 1) for v in values] for side, values in sides.items()},
              "tokens_equal": tokens["baseline"] == tokens["this"]}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0 if result["tokens_equal"] else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rep"]:  # one rep, in a process over the tree on PYTHONPATH (_rep)
        print(json.dumps(measure(int(sys.argv[2]), int(sys.argv[3]))))
        raise SystemExit(0)
    raise SystemExit(main())
