"""CUDA attention over v3 int4 rows and sparse (DSA) attention, each against its baseline in the same run.

    python -m bench.cuda_paths [--quick] [--json] [--emulate]

(a) v3 (int4, polar4) vs fp8, dense decode (S=1): the SAME random rows (with outliers) quantised
    each way, at GLM-5.2 head shapes (H=64, kv_lora=512, rope=64), T = 32k and 128k, SIMT kernel for
    all (v3 adds the q rotation and the context unrotation). Figure: v3 time / fp8 time, and the
    cache bytes each streams.
(b) sparse vs dense over the same cache (f32, fp8, int4 and polar4 rows): each query attends k = 2048
    selected rows (GLM-5.2's index_topk) of T = 128k; S = 1 (decode) and S = 16 (a prefill chunk).
    Figure: sparse time / dense time. The sparse call includes validating and uploading the selection.
Device times are CUDA event medians of interleaved repetitions (cupy); --emulate runs the same
calls on the CPU emulator at tiny shapes (a smoke run of this script: its times say nothing about a
GPU). Without a device and without --emulate, the script says so and exits 0.
JSON keys: int4_over_fp8_ratio_T<T>, polar4_over_fp8_ratio_T<T>, sparse_over_dense_ratio_<kind>_S<S>,
and the *_ms figures.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from bench.report import add_json_flag, json_line
from kernels.fp8 import quantize_rows
from kernels.rows import F32Rows, Fp8Rows, LatentRows, TqRows
from kernels.tq import TqCodec


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_lora: int
    rope: int
    lengths: tuple[int, ...]
    sparse_length: int
    k: int
    prefill: int


GLM = Shape(64, 512, 64, (32_768, 131_072), 131_072, 2048, 16)
GLM_QUICK = Shape(64, 512, 64, (32_768,), 32_768, 2048, 16)
EMULATED = Shape(4, 64, 16, (64,), 64, 16, 2)


def rows_of(shape: Shape, length: int, seed: int) -> dict[str, LatentRows]:
    """The same random rows as f32, fp8, int4 and polar4 blocks (host arrays)."""
    rng = np.random.default_rng(seed)
    lc = rng.standard_normal((length, shape.kv_lora), dtype=np.float32)  # lc: [T, kv_lora] f32
    rc = rng.standard_normal((length, shape.rope), dtype=np.float32)  # rc: [T, rope] f32
    lc *= rng.uniform(0.2, 2.0, (length, 1)).astype(np.float32)
    lc[rng.random(lc.shape) < 0.002] *= 30.0
    lcode, lsc = quantize_rows(lc)
    rcode, rsc = quantize_rows(rc)
    out: dict[str, LatentRows] = {"f32": F32Rows(lc, rc), "fp8": Fp8Rows(lcode, lsc, rcode, rsc)}
    for codec in (TqCodec("int4", 4), TqCodec("polar", 4)):
        lq, lrad = codec.encode_rows(lc)
        rq, rrad = codec.encode_rows(rc)
        out[codec.kv_dtype] = TqRows(lq, lrad, rq, rrad, codec, shape.kv_lora, shape.rope)
    return out


def on_device(xp: Any, rows: LatentRows) -> LatentRows:
    """The block with its arrays uploaded once (timed calls then read them in place)."""
    if xp is np:
        return rows
    fields = {k: (xp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in vars(rows).items()}
    return type(rows)(**fields)


def nbytes(rows: LatentRows) -> int:
    return sum(int(v.nbytes) for v in vars(rows).values() if hasattr(v, "nbytes"))


class Timer:
    """Median seconds of interleaved calls: CUDA events on a device, perf_counter under emulation."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp

    def once(self, fn: Callable[[], object]) -> float:
        if self.xp is np:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        begin, end = self.xp.cuda.Event(), self.xp.cuda.Event()
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return float(self.xp.cuda.get_elapsed_time(begin, end)) / 1e3

    def pair(self, base: Callable[[], object], ours: Callable[[], object], reps: int) -> tuple[float, float]:
        base(), ours()  # warm-up: module builds, first-touch
        tb, to = [], []
        for _ in range(reps):
            tb.append(self.once(base))
            to.append(self.once(ours))
        return statistics.median(tb), statistics.median(to)


def selection(rng: np.random.Generator, n_q: int, length: int, k: int) -> np.ndarray:
    """[S, k] ascending positions; query s (at row length - n_q + s) selects its own row."""
    out = np.empty((n_q, k), np.int64)
    for s in range(n_q):
        pos = length - n_q + s
        out[s] = np.sort(np.append(rng.choice(pos, size=k - 1, replace=False), pos))
    return out


def run(runner: Any, shape: Shape, reps: int) -> dict[str, float | int | str]:
    from kernels.cuda.attention import absorbed_attention_device
    from kernels.cuda.sparse import sparse_absorbed_attention_device

    xp = runner.xp
    timer = Timer(xp)
    rng = np.random.default_rng(1)
    scale = 1.0 / float(np.sqrt(192 + shape.rope))
    out: dict[str, float | int | str] = {}

    def q(n_q: int, width: int) -> Any:
        return xp.asarray((rng.standard_normal((n_q, shape.heads, width)) * 0.1).astype(np.float32))

    print(f"(a) dense decode, v3 vs fp8 (SIMT), H={shape.heads} kv_lora={shape.kv_lora} rope={shape.rope}")
    print(f"{'T':>8} {'v3':>6} {'fp8 ms':>9} {'v3 ms':>9} {'ratio':>6} {'fp8 MiB':>9} {'v3 MiB':>9}")
    mib = float(1 << 20)
    for length in shape.lengths:
        rows = rows_of(shape, length, seed=length)
        fp8 = on_device(xp, rows["fp8"])
        qa, qr = q(1, shape.kv_lora), q(1, shape.rope)
        for name in ("int4", "polar4"):
            v3 = on_device(xp, rows[name])
            t8, t4 = timer.pair(partial(absorbed_attention_device, runner, qa, qr, [fp8], scale),
                                partial(absorbed_attention_device, runner, qa, qr, [v3], scale), reps)
            out[f"fp8_ms_T{length}"], out[f"{name}_ms_T{length}"] = round(t8 * 1e3, 3), round(t4 * 1e3, 3)
            out[f"{name}_over_fp8_ratio_T{length}"] = round(t4 / t8, 3)
            print(f"{length:>8} {name:>6} {t8 * 1e3:>9.3f} {t4 * 1e3:>9.3f} {t4 / t8:>6.2f} {nbytes(fp8) / mib:>9.1f}"
                  f" {nbytes(v3) / mib:>9.1f}")
    length, k = shape.sparse_length, shape.k
    print(f"(b) sparse (k={k}) vs dense over T={length}")
    print(f"{'kind':>5} {'S':>3} {'dense ms':>9} {'sparse ms':>10} {'ratio':>6}")
    rows = rows_of(shape, length, seed=99)
    for kind in ("f32", "fp8", "int4", "polar4"):
        blk = on_device(xp, rows[kind])
        for n_q in (1, shape.prefill):
            qa, qr = q(n_q, shape.kv_lora), q(n_q, shape.rope)
            sel = selection(rng, n_q, length, k)
            td, ts = timer.pair(partial(absorbed_attention_device, runner, qa, qr, [blk], scale),
                                partial(sparse_absorbed_attention_device, runner, qa, qr, [blk], sel, scale), reps)
            out[f"dense_ms_{kind}_S{n_q}"], out[f"sparse_ms_{kind}_S{n_q}"] = round(td * 1e3, 3), round(ts * 1e3, 3)
            out[f"sparse_over_dense_ratio_{kind}_S{n_q}"] = round(ts / td, 4)
            print(f"{kind:>5} {n_q:>3} {td * 1e3:>9.3f} {ts * 1e3:>10.3f} {ts / td:>6.3f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T = 32k only, fewer repetitions")
    add_json_flag(ap)
    ap.add_argument("--emulate", action="store_true", help="the CPU emulator at tiny shapes (a smoke run)")
    args = ap.parse_args(argv)
    reps = 1 if args.emulate else 3 if args.quick else 15
    results: dict[str, Any] = {"quick": args.quick, "reps": reps, "emulated": args.emulate}
    if args.emulate:
        from kernels.cuda.emulator import EmulatorRunner

        results.update(run(EmulatorRunner(n_sm=2), EMULATED, reps))
    else:
        from kernels.cuda.device import cuda_status, get_runner

        ok, reason = cuda_status()
        if ok:
            results["cuda_device"] = get_runner().device_name
            results.update(run(get_runner(), GLM_QUICK if args.quick else GLM, reps))
        else:
            print(f"no CUDA device: {reason} (--emulate runs the calls on the CPU emulator)")
            results["cuda_skipped"] = reason
    return json_line(results, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
