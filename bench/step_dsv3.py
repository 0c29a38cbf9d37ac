"""The batched decode step of DeepSeek-V3 models over fp8 caches in process, before and after issue 36
part 2: process CPU per step of 1 and of 16 sessions on ``tiny`` and on a DeepSeek-V3 layer at
GLM-5.2's attention dims (bench.decoder's ``glm_layer_config``, one dense layer), three ways in
alternating reps: "main" (the reference step as main ran it: each row's attention through
``absorbed_attention``, BLAS over tiles), "ref" (the reference step now: the batch-invariant
attention GLM-5 uses) and "compiled" (the compiled step, which DeepSeek-V3 now takes).

Each rep truncates every cache back to its prompt (40-55 tokens) and runs the same steps, so every
rep does the same work. Process CPU (all threads: the big layer's products are threaded), medians.

    python -m bench.step_dsv3 --json
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.decoder import glm_layer_config, random_weights
from bench.report import figures
from kernels.model import DecoderCache, MLADecoder, parse_config
from kernels.model.decoder import Queries
from kernels.model.step_rows import StepRow
from kernels.model.tiny import tiny_checkpoint

WAYS = ("main", "ref", "compiled")


class MainStepDecoder(MLADecoder):
    """An MLADecoder whose reference step can attend as main's did (``main_attention``)."""

    main_attention = False

    def _attend_step(self, layer: int, x: np.ndarray, q: Queries, cos: np.ndarray, sin: np.ndarray,
                     caches: Sequence[StepRow], step: dict[str, Any]) -> np.ndarray:
        if not self.main_attention:
            return super()._attend_step(layer, x, q, cos, sin, caches, step)
        ctx = np.empty(q.q_abs.shape, np.float32)  # ctx: [B, H, kv_lora] f32
        for b, cache in enumerate(caches):
            ctx[b : b + 1] = cache.backend.absorbed_attention(q.q_abs[b : b + 1], q.q_rope[b : b + 1],
                                                              cache.blocks(layer), self.softmax_scale, causal=True)
        return ctx


def _models() -> dict[str, MainStepDecoder]:
    cfg, weights = tiny_checkpoint()
    layer = glm_layer_config()
    return {"tiny": MainStepDecoder(cfg, weights),
            "v3layer": MainStepDecoder(parse_config(layer, source="v3-layer"), random_weights(layer))}


def _sessions(model: MLADecoder, n: int) -> list[DecoderCache]:
    rng = np.random.default_rng(n)
    caches = []
    for i in range(n):
        cache = model.new_cache("fp8")
        model.forward(rng.integers(0, model.config.vocab_size, 40 + i).astype(np.int32), cache)
        caches.append(cache)
    return caches


def _rep(model: MainStepDecoder, caches: list[DecoderCache], way: str, steps: int) -> float:
    """Process CPU (us) per step of ``steps`` steps of every cache the ``way`` given, the caches
    truncated back after."""
    model.use_compiled, model.main_attention = way == "compiled", way == "main"
    lengths = [c.length for c in caches]
    tokens = np.arange(len(caches), dtype=np.int32)  # [n] i32
    t = time.process_time()
    for _ in range(steps):
        model.step(caches, tokens, [1] * len(caches))
    spent = (time.process_time() - t) / steps * 1e6
    for c, n in zip(caches, lengths, strict=True):
        c.truncate(n)
    model.use_compiled, model.main_attention = True, False
    return spent


def measure(model: MainStepDecoder, reps: int, steps: int) -> dict[str, float]:
    """Medians of every (way, 1 or 16 sessions), reps alternating, after a warm rep of each."""
    assert model.compiled_step() is not None, "the compiled step must take this model"
    batches = {1: _sessions(model, 1), 16: _sessions(model, 16)}
    got: dict[str, list[float]] = {f"{way}{n}": [] for way in WAYS for n in batches}
    for caches in batches.values():
        for way in WAYS:
            _rep(model, caches, way, 1)
    for _ in range(reps):
        for n, caches in batches.items():
            for way in WAYS:
                got[f"{way}{n}"].append(_rep(model, caches, way, steps))
    return {k: statistics.median(v) for k, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_dsv3", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--reps", type=int, default=9, help="reps per figure (medians)")
    parser.add_argument("--quick", action="store_true", help="3 reps per figure")
    args = parser.parse_args(argv)
    reps = 3 if args.quick else args.reps
    result: dict[str, float] = {}
    for name, model in _models().items():
        steps = 8 if name == "tiny" else 2
        med = measure(model, reps, steps)
        for key, value in med.items():
            result[f"dsv3_{name}_{key}_us"] = round(value, 1)
        for n in (1, 16):
            result[f"dsv3_{name}_compiled{n}_over_main"] = round(med[f"compiled{n}"] / med[f"main{n}"], 3)
            result[f"dsv3_{name}_ref{n}_over_main"] = round(med[f"ref{n}"] / med[f"main{n}"], 3)
    return figures(result, args.json, width=36)


if __name__ == "__main__":
    raise SystemExit(main())
