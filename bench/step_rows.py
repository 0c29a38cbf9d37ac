"""The batched decode step of glm-mini over fp8 caches (the server's default) in process: thread CPU
per step of 1 and of 16 sessions on the compiled step, with the reference (numpy) step of 16 as the
baseline measured in the same run, reps alternating between the two; plus the incremental
detokenising's CPU per token (kernels.model.text.StreamDecoder on glm-mini's tokenizer).

Each rep truncates every cache back to its prompt (40-55 tokens: past ``index_topk``, so selection
scores) and runs the same steps, so every rep does the same work. Thread CPU, not wall time: the
figures hold on a loaded machine (issue 36 part 6).

    python -m bench.step_rows --json
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.report import figures
from kernels.model import DecoderCache, MLADecoder, load_model, resolve_model
from kernels.model.text import StreamDecoder, load_text

STEPS = 8  # steps per rep


def decode_sessions(model: MLADecoder, n: int) -> list[DecoderCache]:
    """``n`` fp8 caches of glm-mini, cache i over a random prompt of 40 + i tokens (past index_topk)."""
    rng = np.random.default_rng(n)
    caches = []
    for i in range(n):
        cache = model.new_cache("fp8")
        model.forward(rng.integers(0, 3072, 40 + i).astype(np.int32), cache)
        caches.append(cache)
    return caches


def _rep(model: MLADecoder, caches: list[DecoderCache], compiled: bool) -> float:
    """Thread CPU (us) per step of ``STEPS`` steps of every cache, the caches truncated back after."""
    model.use_compiled = compiled
    lengths = [c.length for c in caches]
    tokens = np.arange(len(caches), dtype=np.int32)  # [n] i32
    t = time.thread_time()
    for _ in range(STEPS):
        model.step(caches, tokens, [1] * len(caches))
    spent = (time.thread_time() - t) / STEPS * 1e6
    for c, n in zip(caches, lengths, strict=True):
        c.truncate(n)
    model.use_compiled = True
    return spent


def _detok_us() -> float:
    tok = load_text(resolve_model("glm-mini"))
    ids = tok.encode("The quick brown fox jumps over the lazy dog, caf\u00e9 \u4e2d\u6587. " * 20)[:128]
    spent = []
    for _ in range(30):
        stream = StreamDecoder(tok)
        t = time.thread_time()
        for i in ids:
            stream.push(i)
        stream.finish()
        spent.append((time.thread_time() - t) / len(ids) * 1e6)
    return statistics.median(spent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_rows", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--reps", type=int, default=15, help="reps per figure (medians)")
    args = parser.parse_args(argv)
    model = load_model(resolve_model("glm-mini"))
    one, many = decode_sessions(model, 1), decode_sessions(model, 16)
    for compiled in (True, False):  # warm: compiled code and layouts
        _rep(model, many, compiled)
    _rep(model, one, True)
    got: dict[str, list[float]] = {"step1": [], "step16": [], "ref16": []}
    for _ in range(args.reps):
        got["step16"].append(_rep(model, many, True))
        got["ref16"].append(_rep(model, many, False))
        got["step1"].append(_rep(model, one, True))
    med = {k: statistics.median(v) for k, v in got.items()}
    result = {"step_rows1_us": round(med["step1"], 1), "step_rows16_us": round(med["step16"], 1),
              "step_rows16_ref_us": round(med["ref16"], 1),
              "step_rows16_ref_ratio": round(med["step16"] / med["ref16"], 3),
              "detok_us_per_token": round(_detok_us(), 2)}
    return figures(result, args.json, width=24)


if __name__ == "__main__":
    raise SystemExit(main())
