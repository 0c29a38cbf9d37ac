"""The compiled step at GLM-5.2's layer dims by row count, in process: CPU per step of n sessions
(n = 1-8 and 16, one decode token each) and of one session taking a 7-token prompt (the first token
of one: a step of 7 rows), on ``bench.serve_core``'s two-layer checkpoint (one dense
layer, one MoE layer of ``--experts`` routed experts; random f32 weights, fp8 caches of 8 positions).

One thread by default (``numba.set_num_threads``), process CPU, row counts alternating within each
rep, medians. Each step is undone after it (every cache cut back to its 8 positions), so every rep
does the same work. The first step of each shape is not timed; numba compiles at the sessions'
prefill, inside ``glm52_step_build_s`` (with a fresh ``NUMBA_CACHE_DIR``: the cold compile). Memory: about 7.8
GiB at its peak with 8 experts (the checkpoint's weights and the compiled step's packed copy).

This module imports only ``kernels`` and ``bench.serve_core``, so the same file measures another
tree: ``PYTHONPATH=/work/main python bench/step_glm52.py --json`` (a baseline for the same run).

    python -m bench.step_glm52 --json
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Any

import numba
import numpy as np

from bench.report import figures
from bench.serve_core import glm52_layers_config
from kernels.model.config import parse_config
from kernels.model.glm_decoder import GlmDecoder
from kernels.model.tiny_glm import tiny_glm_weights
from kernels.model.weights import DictWeights

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 16)
PROMPT = 7  # the prompt of the first token of one (bench.peer_glm52's)
POSITIONS = 8  # positions each session holds before a timed step


def build_model(experts: int) -> GlmDecoder:
    """The two-layer checkpoint at GLM-5.2's dims with ``experts`` routed experts (random f32 weights)."""
    config = parse_config(glm52_layers_config(experts), source="bench-step-glm52")
    return GlmDecoder(config, DictWeights(tiny_glm_weights(config, 7), source="bench-step-glm52"))


def sessions(model: GlmDecoder, n: int) -> list[Any]:
    """``n`` fp8 caches over one prefill's ``POSITIONS`` rows (what a step costs does not depend on
    their values), each appending its own."""
    first = model.new_cache("fp8")
    model.forward(np.random.default_rng(3).integers(2, 4000, POSITIONS).astype(np.int32), first)
    blocks = [first.blocks(layer) for layer in range(model.config.n_layers)]
    return [first] + [model.cache_from_blocks(blocks, first.tokens, kv_dtype="fp8", index_rows=first.index_rows())
                      for _ in range(n - 1)]


def _timed(model: GlmDecoder, caches: list[Any], counts: list[int]) -> float:
    """Process CPU seconds of one step of ``caches`` taking ``counts`` tokens each, undone after."""
    tokens = (np.arange(sum(counts)) % 4000 + 2).astype(np.int32)  # [N] i32
    t = time.process_time()
    model.step(caches, tokens, counts)
    spent = time.process_time() - t
    for cache in caches:
        cache.truncate(POSITIONS)
    return spent


def measure(experts: int, reps: int) -> dict[str, Any]:
    """Medians (ms) of every step shape, reps alternating over the shapes, after an untimed one each."""
    t0 = time.process_time()
    model = build_model(experts)
    caches = sessions(model, max(ROW_COUNTS))
    assert model.compiled_step() is not None, "the compiled step must take this model"
    shapes = {f"rows{n}": (caches[:n], [1] * n) for n in ROW_COUNTS}
    shapes[f"prompt{PROMPT}"] = (caches[:1], [PROMPT])
    built = time.process_time() - t0
    t0 = time.process_time()
    for group, counts in shapes.values():
        _timed(model, group, counts)
    warm = time.process_time() - t0
    got: dict[str, list[float]] = {name: [] for name in shapes}
    for _ in range(reps):
        for name, (group, counts) in shapes.items():
            got[name].append(_timed(model, group, counts))
    result: dict[str, Any] = {f"glm52_step_{name}_ms": round(statistics.median(v) * 1e3, 1) for name, v in got.items()}
    result.update({"glm52_step_experts": experts, "glm52_step_reps": reps, "glm52_step_build_s": round(built, 1),
                   "glm52_step_first_steps_s": round(warm, 1),
                   "glm52_step_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)})
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_glm52", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--reps", type=int, default=3, help="reps per figure (medians)")
    parser.add_argument("--quick", action="store_true", help="1 rep (building the weights still takes 1-2 minutes)")
    parser.add_argument("--experts", type=int, default=8, help="routed experts of the MoE layer (151 MB each)")
    parser.add_argument("--threads", type=int, default=1, help="numba threads (the table's figures: one)")
    args = parser.parse_args(argv)
    numba.set_num_threads(args.threads)
    result = measure(args.experts, 1 if args.quick else args.reps)
    result["glm52_step_threads"] = args.threads
    return figures(result, args.json, width=32)


if __name__ == "__main__":
    raise SystemExit(main())
