"""fp8 e4m3 codec throughput against ml_dtypes' astype on the same array, in the same run.

    python -m bench.codec [--quick] [--json]

Encode: kernels.fp8.encode(x) vs x.astype(ml_dtypes.float8_e4m3fn) on GLM-shaped latent rows
already scaled into the e4m3 range (what the row quantizer feeds the encoder). Decode:
kernels.fp8.decode(codes) vs codes.view(float8_e4m3fn).astype(float32). Both sides are timed
alternately, medians of several repetitions; the results are checked equal before timing.
Row quantizer and dequantizer throughputs are printed for information (no baseline exists).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

from bench.report import add_json_flag, json_line
from kernels import fp8

F8 = ml_dtypes.float8_e4m3fn


def latent_rows(n_rows: int, width: int, seed: int = 0) -> np.ndarray:
    """[n_rows, width] f32 rows with a per-row magnitude spread, like Lc rows of a real model."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n_rows, width), dtype=np.float32)  # [R, 576] f32
    rows *= np.exp(rng.uniform(-4, 4, (n_rows, 1))).astype(np.float32)
    return rows


Timed = Callable[[], object]


def paired_medians(base: Timed, ours: Timed, reps: int) -> tuple[float, float]:
    """Time base and ours alternately (same machine state), return the two medians in seconds."""
    base(), ours()  # warm caches and lazily built tables
    base_times: list[float] = []
    our_times: list[float] = []
    for _ in range(reps):
        for fn, sink in ((base, base_times), (ours, our_times)):
            start = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - start)
    return statistics.median(base_times), statistics.median(our_times)


def run(n_values: int, reps: int) -> dict[str, float]:
    width = 576  # kv_lora 512 + qk_rope 64, quantized as one block here
    rows = latent_rows(max(1, n_values // width), width)  # [R, 576] f32
    amax = np.abs(rows).max(axis=1, keepdims=True)  # [R, 1] f32
    x = (rows * (np.float32(448) / amax)).reshape(-1)  # [N] f32 within +-448
    n = x.size

    codes = fp8.encode(x)  # [N] u8
    if not np.array_equal(codes, x.astype(F8).view(np.uint8)):
        raise SystemExit("encode disagrees with ml_dtypes on the benchmark array")
    if not np.array_equal(fp8.decode(codes), codes.view(F8).astype(np.float32)):
        raise SystemExit("decode disagrees with ml_dtypes on the benchmark array")

    enc_base, enc_ours = paired_medians(lambda: x.astype(F8), lambda: fp8.encode(x), reps)
    f8_view = codes.view(F8)
    dec_base, dec_ours = paired_medians(
        lambda: f8_view.astype(np.float32), lambda: fp8.decode(codes), reps
    )
    _, quant = paired_medians(lambda: None, lambda: fp8.quantize_rows(rows), reps)
    q_codes, q_scales = fp8.quantize_rows(rows)
    _, dequant = paired_medians(lambda: None, lambda: fp8.dequantize_rows(q_codes, q_scales), reps)
    return {
        "n_values": n,
        "repetitions": reps,
        "encode_ratio_vs_ml_dtypes": enc_base / enc_ours,
        "decode_ratio_vs_ml_dtypes": dec_base / dec_ours,
        "encode_ns_per_value": enc_ours / n * 1e9,
        "encode_ml_dtypes_ns_per_value": enc_base / n * 1e9,
        "decode_ns_per_value": dec_ours / n * 1e9,
        "decode_ml_dtypes_ns_per_value": dec_base / n * 1e9,
        "quantize_rows_ns_per_value": quant / n * 1e9,
        "dequantize_rows_ns_per_value": dequant / n * 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4M values, 5 repetitions (< 1 minute)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    n_values, reps = ((1 << 22), 5) if args.quick else ((1 << 24), 9)
    result = run(n_values, reps)
    print(f"fp8 e4m3 codec, {result['n_values']:,} values, median of {reps}")
    print(f"{'operation':<18}{'ours ns/value':>15}{'ml_dtypes ns/value':>20}{'ratio':>8}")
    for op in ("encode", "decode"):
        ours, theirs = result[op + "_ns_per_value"], result[op + "_ml_dtypes_ns_per_value"]
        print(f"{op:<18}{ours:>15.2f}{theirs:>20.2f}{result[op + '_ratio_vs_ml_dtypes']:>7.2f}x")
    for op in ("quantize_rows", "dequantize_rows"):
        print(f"{op:<18}{result[op + '_ns_per_value']:>15.2f}{'-':>20}{'-':>8}")
    return json_line(result, args.json, sort_keys=True)


if __name__ == "__main__":
    raise SystemExit(main())
