"""One DSA decode step on CPU: indexer + top-k + sparse attention vs dense absorbed attention.

    python -m bench.dsa [--quick] [--json] [--length T]

GLM-5.2 attention shapes: H=64 heads, kv_lora=512, rope=64 (qk_nope=192 sets the softmax scale),
32 indexer heads of 128, index_topk=2048, one query (S=1) at position T-1 over T cached rows
(T=131072; --quick: T=32768, fewer repetitions, and the keys say so). The SAME random rows
(with outliers; fp8 = those rows through the row quantizer) and the same queries feed both paths:
- sparse: the indexer's scores over all T keys (Ic rows, f32) + the engine's top-k, then absorbed
  attention over the 2048 selected rows only (``select_rows`` + ``sparse_absorbed_attention``);
- dense: absorbed attention over all T rows (``absorbed_attention``), the baseline.
Timed alternately, medians; the figure is the median over rounds of dense time / sparse time (both
timed back to back in each round, so a busy machine slows both alike; goal >= 8x), for fp8 rows
(the sessions' default) and f32 rows; the sparse step is also split into scoring, top-k and
attention so the notes can say where the time goes.
JSON keys: dsa_speedup_T<T> (fp8), dsa_speedup_f32_T<T>, and *_ms for every part.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from bench.report import add_json_flag, json_line
from kernels.attention import absorbed_attention, engine_topk, index_scores, select_rows, sparse_absorbed_attention
from kernels.fp8 import quantize_rows
from kernels.rows import F32Rows, Fp8Rows

H, KV, ROPE, NOPE = 64, 512, 64, 192
NH, HD, TOPK = 32, 128, 2048
SCALE = 1.0 / float(np.sqrt(NOPE + ROPE))


def make_rows(length: int, seed: int) -> tuple[F32Rows, Fp8Rows, np.ndarray]:
    """Latent rows (f32 and their fp8 form) and indexer keys [T, hd] f32."""
    rng = np.random.default_rng(seed)
    lc = rng.standard_normal((length, KV), dtype=np.float32)  # lc: [T, kv_lora] f32
    rc = rng.standard_normal((length, ROPE), dtype=np.float32)  # rc: [T, rope] f32
    lc *= rng.uniform(0.2, 2.0, (length, 1)).astype(np.float32)
    lc[rng.random(lc.shape) < 0.002] *= 30.0
    lc_codes, lc_scale = quantize_rows(lc)
    rc_codes, rc_scale = quantize_rows(rc)
    keys = rng.standard_normal((length, HD), dtype=np.float32)  # keys: [T, hd] f32
    return F32Rows(lc, rc), Fp8Rows(lc_codes, lc_scale, rc_codes, rc_scale), keys


def timings(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Each function once to warm up, then ``reps`` rounds in turn; seconds by name, one per round."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(base: list[float], ours: list[float]) -> float:
    """Median over rounds of base / ours (each round times both back to back: robust to a shared machine)."""
    return statistics.median(b / o for b, o in zip(base, ours, strict=True))


def run(length: int, reps: int) -> dict[str, float]:
    f32_rows, fp8_rows, keys = make_rows(length, seed=length)
    rng = np.random.default_rng(11)
    qa = (rng.standard_normal((1, H, KV)) * 0.1).astype(np.float32)  # qa: [1, H, kv_lora]
    qr = (rng.standard_normal((1, H, ROPE)) * 0.1).astype(np.float32)  # qr: [1, H, rope]
    qi = rng.standard_normal((1, NH, HD)).astype(np.float32)  # qi: [1, nh, hd] indexer query
    w = (rng.standard_normal((1, NH)) * NH**-0.5).astype(np.float32)  # w: [1, nh] head weights
    first = length - 1
    sel = select_rows(qi, w, [keys], first, TOPK)  # [1, k] i64
    scores = index_scores(qi, w, [keys], first)  # [1, T] f32

    def sparse(rows: F32Rows | Fp8Rows) -> Callable[[], object]:
        def step() -> object:
            chosen = select_rows(qi, w, [keys], first, TOPK)
            return sparse_absorbed_attention(qa, qr, [rows], chosen, SCALE)
        return step

    times = timings({
        "dense_fp8": lambda: absorbed_attention(qa, qr, [fp8_rows], SCALE),
        "sparse_fp8": sparse(fp8_rows),
        "dense_f32": lambda: absorbed_attention(qa, qr, [f32_rows], SCALE),
        "sparse_f32": sparse(f32_rows),
        "scoring": lambda: index_scores(qi, w, [keys], first),
        "topk": lambda: engine_topk(scores, first, TOPK),
        "attend_fp8": lambda: sparse_absorbed_attention(qa, qr, [fp8_rows], sel, SCALE),
        "attend_f32": lambda: sparse_absorbed_attention(qa, qr, [f32_rows], sel, SCALE),
    }, reps)
    t = {name: statistics.median(ts) for name, ts in times.items()}
    out: dict[str, float] = {f"{name}_ms_T{length}": round(v * 1e3, 3) for name, v in t.items()}
    speedup = {kind: paired_ratio(times["dense_" + kind], times["sparse_" + kind]) for kind in ("fp8", "f32")}
    out[f"dsa_speedup_T{length}"] = round(speedup["fp8"], 2)
    out[f"dsa_speedup_f32_T{length}"] = round(speedup["f32"], 2)
    mult = {"scoring": NH * HD * length, "attend": H * TOPK * (2 * KV + ROPE), "dense": H * length * (2 * KV + ROPE)}
    print(f"T={length}, top-k {TOPK}, {reps} reps (medians, ms); multiply-adds: indexer {mult['scoring'] / 1e6:.0f}M,"
          f" sparse attention {mult['attend'] / 1e6:.0f}M, dense attention {mult['dense'] / 1e6:.0f}M")
    for kind in ("fp8", "f32"):
        print(f"  {kind}: dense {t['dense_' + kind] * 1e3:8.2f}  sparse {t['sparse_' + kind] * 1e3:8.2f}"
              f"  (scoring {t['scoring'] * 1e3:.2f} + top-k {t['topk'] * 1e3:.2f} + attention"
              f" {t['attend_' + kind] * 1e3:.2f})  speedup {speedup[kind]:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T=32768 and 3 repetitions (the keys name the T)")
    add_json_flag(ap)
    ap.add_argument("--length", type=int, default=None, help="cached rows T (default 131072; --quick 32768)")
    args = ap.parse_args(argv)
    length = args.length or (32_768 if args.quick else 131_072)
    if length <= TOPK:
        ap.error(f"--length must exceed index_topk={TOPK}")
    reps = 3 if args.quick else 9
    results: dict = {"quick": args.quick, "reps": reps, "T": length, "index_topk": TOPK}
    results.update(run(length, reps))
    return json_line(results, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
