"""Absorbed MLA decode attention: CPU fp8 vs CPU f32 on the same rows, and CUDA fp8 bandwidth.

    python -m bench.attention [--quick] [--json] [--with-decoder]

CPU: one decode step (S=1) at GLM-5.2 head shapes (H=64, kv_lora=512, rope=64; qk_nope=192,
v_head=256 set the softmax scale) over T = 4k, 32k, 128k cached rows. The f32 cache is random
rows with outliers; the fp8 cache is the SAME rows through the row quantizer. Both paths are
timed alternately (medians); the figure is fp8 time / f32 time (target <= 2.0, stretch 1.2).
The extra memory of each call (tracemalloc peak: tiles, scores, output) is reported beside the
cache bytes.

CUDA (only when a device answers): 16 sessions x T=128k fp8 rows in ONE batched launch; the
effective bandwidth is the cache bytes (codes + scales) over the kernel time, as a fraction of
the device's peak memory bandwidth (H200: 4.8 TB/s; others from the device's memory clock and
bus width). Kernels: mma_fast (the figure), mma and simt (printed).

--with-decoder runs bench.decoder (the reference decoder's tokens/s) afterwards and nests
its JSON under "decoder".
JSON keys: cpu_fp8_over_f32_ratio_T<T> for each T, cuda_fp8_bandwidth_fraction when measured.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from functools import partial

import numpy as np

from bench.report import add_json_flag, json_line
from kernels.attention import absorbed_attention
from kernels.fp8 import quantize_rows
from kernels.rows import F32Rows, Fp8Rows

H, KV, ROPE, NOPE = 64, 512, 64, 192
SCALE = 1.0 / float(np.sqrt(NOPE + ROPE))
LENGTHS = (4096, 32_768, 131_072)
PEAK_BYTES_PER_S = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12,
                    "H800": 3.35e12, "A100-SXM4-80GB": 2.04e12, "A100": 1.555e12}


def make_cache(length: int, seed: int) -> tuple[F32Rows, Fp8Rows]:
    rng = np.random.default_rng(seed)
    lc = rng.standard_normal((length, KV), dtype=np.float32)  # lc: [T, kv_lora] f32
    rc = rng.standard_normal((length, ROPE), dtype=np.float32)  # rc: [T, rope] f32
    lc *= rng.uniform(0.2, 2.0, (length, 1)).astype(np.float32)
    lc[rng.random(lc.shape) < 0.002] *= 30.0
    lc_codes, lc_scale = quantize_rows(lc)
    rc_codes, rc_scale = quantize_rows(rc)
    return F32Rows(lc, rc), Fp8Rows(lc_codes, lc_scale, rc_codes, rc_scale)


def cache_bytes(rows: F32Rows | Fp8Rows) -> int:
    if isinstance(rows, F32Rows):
        return rows.lc.nbytes + rows.rc.nbytes
    return rows.lc_codes.nbytes + rows.rc_codes.nbytes + rows.lc_scale.nbytes + rows.rc_scale.nbytes


def paired_medians(base: Callable[[], object], ours: Callable[[], object], reps: int) -> tuple[float, float]:
    base(), ours()  # warm-up
    tb: list[float] = []
    to: list[float] = []
    for _ in range(reps):
        for fn, sink in ((base, tb), (ours, to)):
            start = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - start)
    return statistics.median(tb), statistics.median(to)


def peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def run_cpu(reps: int) -> dict[str, float]:
    results: dict[str, float] = {}
    rng = np.random.default_rng(7)
    qa = (rng.standard_normal((1, H, KV)) * 0.1).astype(np.float32)  # [1, H, kv_lora]
    qr = (rng.standard_normal((1, H, ROPE)) * 0.1).astype(np.float32)  # [1, H, rope]
    print(f"{'T':>8} {'f32 ms':>9} {'fp8 ms':>9} {'ratio':>6} {'f32 cache MiB':>14} {'fp8 cache MiB':>14}"
          f" {'f32 extra MiB':>14} {'fp8 extra MiB':>14}")
    for length in LENGTHS:
        f32_rows, fp8_rows = make_cache(length, seed=length)
        f32_call = partial(absorbed_attention, qa, qr, [f32_rows], SCALE)
        fp8_call = partial(absorbed_attention, qa, qr, [fp8_rows], SCALE)
        t32, t8 = paired_medians(f32_call, fp8_call, reps)
        m32, m8 = peak_bytes(f32_call), peak_bytes(fp8_call)
        ratio = t8 / t32
        results[f"cpu_fp8_over_f32_ratio_T{length}"] = round(ratio, 3)
        results[f"cpu_f32_ms_T{length}"] = round(t32 * 1e3, 2)
        results[f"cpu_fp8_ms_T{length}"] = round(t8 * 1e3, 2)
        results[f"cpu_f32_cache_bytes_T{length}"] = cache_bytes(f32_rows)
        results[f"cpu_fp8_cache_bytes_T{length}"] = cache_bytes(fp8_rows)
        results[f"cpu_f32_extra_bytes_T{length}"] = m32
        results[f"cpu_fp8_extra_bytes_T{length}"] = m8
        mib = 1 << 20
        print(f"{length:>8} {t32 * 1e3:>9.2f} {t8 * 1e3:>9.2f} {ratio:>6.2f} {cache_bytes(f32_rows) / mib:>14.1f}"
              f" {cache_bytes(fp8_rows) / mib:>14.1f} {m32 / mib:>14.2f} {m8 / mib:>14.2f}")
    return results


def device_peak(cp) -> tuple[str, float, str]:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode(errors="replace")
    for key, peak in PEAK_BYTES_PER_S.items():
        if key in name:
            return name, peak, "table"
    peak = 2.0 * props["memoryClockRate"] * 1e3 * props["memoryBusWidth"] / 8  # DDR: 2 transfers a clock
    return name, float(peak), "memory clock x bus width"


def run_cuda(reps: int) -> dict[str, float | str]:
    from kernels.cuda.device import cuda_status

    ok, reason = cuda_status()
    if not ok:
        print(f"CUDA section skipped: {reason}")
        return {"cuda_skipped": reason}
    import cupy as cp

    from bench.cuda_batch import batched_decode_device
    from kernels.cuda.device import get_runner

    runner = get_runner()
    name, peak, source = device_peak(cp)
    sessions, length = 16, 131_072
    host_rng = np.random.default_rng(3)
    caches = []
    for _ in range(sessions):
        codes = cp.asarray(host_rng.integers(0, 256, (length, KV + ROPE), dtype=np.uint8))  # [T, 576] u8
        scales = cp.asarray(host_rng.uniform(0.001, 0.01, (2, length)).astype(np.float32))  # [2, T] f32
        caches.append(Fp8Rows(codes[:, :KV], scales[0], codes[:, KV:], scales[1]))
    total = sum(c.lc_codes.shape[0] * (KV + ROPE + 8) for c in caches)
    qa = cp.asarray((np.random.default_rng(1).standard_normal((sessions, H, KV)) * 0.1).astype(np.float32))
    qr = cp.asarray((np.random.default_rng(2).standard_normal((sessions, H, ROPE)) * 0.1).astype(np.float32))
    out: dict[str, float | str] = {"cuda_device": name, "cuda_peak_bytes_per_s": peak, "cuda_peak_source": source,
                                   "cuda_sessions": sessions, "cuda_T": length, "cuda_cache_bytes": total}
    print(f"CUDA: {name}, peak {peak / 1e12:.2f} TB/s ({source}); {sessions} sessions x T={length}, "
          f"{total / 2**30:.2f} GiB of fp8 rows")
    for kernel in ("mma_fast", "mma", "simt"):
        run = partial(batched_decode_device, runner, qa, qr, caches, SCALE, kernel=kernel)
        run()
        cp.cuda.Device().synchronize()
        times = []
        for _ in range(reps):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            run()
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
        t = statistics.median(times)
        frac = total / t / peak
        out[f"cuda_{kernel}_ms"] = round(t * 1e3, 3)
        out[f"cuda_{kernel}_bandwidth_fraction"] = round(frac, 4)
        print(f"  {kernel:>9}: {t * 1e3:8.3f} ms  {total / t / 1e12:6.2f} TB/s  {100 * frac:5.1f}% of peak")
    out["cuda_fp8_bandwidth_fraction"] = out["cuda_mma_fast_bandwidth_fraction"]
    return out


def run_decoder(quick: bool) -> dict:
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    if not os.path.exists(os.path.join(bench_dir, "decoder.py")):
        return {}
    cmd = [sys.executable, "-m", "bench.decoder", "--json"] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=os.path.dirname(bench_dir))
    print(done.stdout.rstrip())
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"decoder_error": done.stderr[-500:]}
    return {"decoder": json.loads(lines[-1])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (< 1 minute on 2 cores)")
    add_json_flag(ap)
    ap.add_argument("--with-decoder", action="store_true", help="also run bench.decoder and nest its figures")
    args = ap.parse_args(argv)
    reps = 3 if args.quick else 9
    results: dict = {"quick": args.quick, "reps": reps}
    results.update(run_cpu(reps))
    results.update(run_cuda(5 if args.quick else 20))
    if args.with_decoder:
        results.update(run_decoder(args.quick))
    return json_line(results, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
