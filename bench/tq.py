"""The v3 4-bit tier: attention over v3 rows vs f32 rows, codec throughput, error, bytes per token.

    python -m bench.tq [--quick] [--json]

(a) One absorbed decode step (S=1) at GLM-5.2 head shapes (H=64, kv_lora=512, rope=64; the softmax
    scale from qk_nope=192) over T=32,768 rows: v3 rows (int4, polar4) vs f32 rows of the SAME
    content (the v3 rows decoded), timed alternately, medians; ratio = v3 time / f32 time (goal for
    int4 <= 1.5). The extra memory of a call (tracemalloc peak) is printed beside it.
(b) encode_rows / decode_rows throughput (Melem/s) of int4 and polar2..6 on gaussian [R, 512] rows.
(c) Mean relative L2 error ||decode(encode(x)) - x|| / ||x|| on gaussian rows of width 512 and 64.
(d) Record bytes per token at GLM-5.2 shapes (78 layers, 512, 64, no indexer rows): v1, v2, v3.
JSON keys: cpu_int4_over_f32_ratio_T32768, cpu_polar4_over_f32_ratio_T32768, <codec>_encode_melem_s,
<codec>_decode_melem_s, <codec>_rel_err_n<width>, bytes_per_token_<tier>.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from bench.attention import paired_medians, peak_bytes
from bench.report import add_json_flag, json_line
from kernels.attention import absorbed_attention
from kernels.rows import F32Rows, TqRows
from kernels.tq import KV_DTYPES_V3, TqCodec

H, KV, ROPE, NOPE, LAYERS = 64, 512, 64, 192, 78
SCALE = 1.0 / float(np.sqrt(NOPE + ROPE))
LENGTH = 32_768


def latent_rows(length: int, width: int, seed: int) -> np.ndarray:
    """Gaussian rows with a per-row magnitude spread and rare 30x outliers: [T, width] f32."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((length, width), dtype=np.float32)  # rows: [T, width] f32
    rows *= rng.uniform(0.2, 2.0, (length, 1)).astype(np.float32)
    rows[rng.random(rows.shape) < 0.002] *= 30.0
    return rows


def v3_cache(codec: TqCodec, lc: np.ndarray, rc: np.ndarray) -> tuple[TqRows, F32Rows]:
    """The rows as v3 blocks, and the same content decoded to f32 (the baseline's rows)."""
    lcode, lrad = codec.encode_rows(lc)
    rcode, rrad = codec.encode_rows(rc)
    rows = TqRows(lcode, lrad, rcode, rrad, codec, KV, ROPE)
    return rows, F32Rows(codec.decode_rows(lcode, lrad, KV), codec.decode_rows(rcode, rrad, ROPE))


def run_attention(reps: int, length: int = LENGTH) -> dict[str, float]:
    out: dict[str, float] = {}
    lc, rc = latent_rows(length, KV, 1), latent_rows(length, ROPE, 2)
    rng = np.random.default_rng(7)
    qa = (rng.standard_normal((1, H, KV)) * 0.1).astype(np.float32)  # qa: [1, H, kv_lora] f32
    qr = (rng.standard_normal((1, H, ROPE)) * 0.1).astype(np.float32)  # qr: [1, H, rope] f32
    print(f"(a) decode step, H={H}, T={length}: {'tier':>7} {'f32 ms':>8} {'v3 ms':>8} {'ratio':>6}"
          f" {'v3 cache MiB':>13} {'v3 extra MiB':>13}")
    for name in ("int4", "polar4"):
        codec = TqCodec.from_kv_dtype(name)
        tq, f32 = v3_cache(codec, lc, rc)
        base = partial(absorbed_attention, qa, qr, [f32], SCALE)
        ours = partial(absorbed_attention, qa, qr, [tq], SCALE)
        err = float(np.abs(ours() - base()).max() / np.abs(base()).max())
        t32, tv3 = paired_medians(base, ours, reps)
        extra = peak_bytes(ours)
        cache = tq.lc_codes.nbytes + tq.rc_codes.nbytes + tq.lc_radius.nbytes + tq.rc_radius.nbytes
        out[f"cpu_{name}_over_f32_ratio_T{length}"] = round(tv3 / t32, 3)
        out[f"cpu_f32_ms_T{length}_{name}_run"] = round(t32 * 1e3, 2)
        out[f"cpu_{name}_ms_T{length}"] = round(tv3 * 1e3, 2)
        out[f"cpu_{name}_extra_bytes_T{length}"] = extra
        out[f"cpu_{name}_vs_decoded_rel_err"] = err
        print(f"{'':>36} {name:>7} {t32 * 1e3:>8.2f} {tv3 * 1e3:>8.2f} {tv3 / t32:>6.2f}"
              f" {cache / 2**20:>13.1f} {extra / 2**20:>13.2f}   (max rel diff vs f32 path {err:.1e})")
    return out


def median_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_codecs(rows: int, reps: int) -> dict[str, float]:
    out: dict[str, float] = {}
    x = np.random.default_rng(3).standard_normal((rows, KV), dtype=np.float32)  # x: [R, 512] f32
    x64 = np.random.default_rng(4).standard_normal((rows, ROPE), dtype=np.float32)  # x64: [R, 64] f32
    print(f"(b, c) {rows} gaussian rows: {'tier':>7} {'encode Melem/s':>15} {'decode Melem/s':>15}"
          f" {'rel err n512':>13} {'rel err n64':>12}")
    for name in KV_DTYPES_V3:
        codec = TqCodec.from_kv_dtype(name)
        codes, radius = codec.encode_rows(x)
        t_enc = median_time(partial(codec.encode_rows, x), reps)
        t_dec = median_time(partial(codec.decode_rows, codes, radius, KV), reps)
        errs = []
        for rows_w in (x, x64):
            c, r = codec.encode_rows(rows_w)
            dec = codec.decode_rows(c, r, rows_w.shape[1])
            errs.append(float(np.mean(np.linalg.norm(dec - rows_w, axis=1) / np.linalg.norm(rows_w, axis=1))))
        out[f"{name}_encode_melem_s"] = round(x.size / t_enc / 1e6, 2)
        out[f"{name}_decode_melem_s"] = round(x.size / t_dec / 1e6, 2)
        out[f"{name}_rel_err_n512"] = round(errs[0], 4)
        out[f"{name}_rel_err_n64"] = round(errs[1], 4)
        print(f"{'':>28} {name:>7} {x.size / t_enc / 1e6:>15.1f} {x.size / t_dec / 1e6:>15.1f}"
              f" {errs[0]:>13.4f} {errs[1]:>12.4f}")
    return out


def bytes_per_token() -> dict[str, int]:
    """Record sizes at GLM-5.2 shapes without indexer rows (coli_kv-format.md, facts 4)."""
    out = {"bytes_per_token_v1_f32": 4 + LAYERS * (KV + ROPE) * 4,
           "bytes_per_token_v2_fp8": 4 + LAYERS * (KV + ROPE + 8)}
    for name in KV_DTYPES_V3:
        c = TqCodec.from_kv_dtype(name)
        out[f"bytes_per_token_v3_{name}"] = 4 + LAYERS * (c.row_bytes(KV) + 4 + c.row_bytes(ROPE) + 4)
    print("(d) bytes per token, GLM-5.2 (78 x (512 + 64)), no indexer rows: "
          + ", ".join(f"{k.removeprefix('bytes_per_token_')} {v:,}" for k, v in out.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and rows (about a minute on 2 cores)")
    add_json_flag(ap)
    ap.add_argument("--length", type=int, default=LENGTH, help=f"cached rows T of (a) (default {LENGTH})")
    ap.add_argument("--rows", type=int, default=0, help="rows of (b, c) (default 1024 with --quick, else 4096)")
    args = ap.parse_args(argv)
    if args.length < 1 or args.rows < 0:
        ap.error("--length must be >= 1 and --rows >= 0")
    reps = 5 if args.quick else 11
    results: dict[str, object] = {"quick": args.quick, "reps": reps, "length": args.length}
    results.update(run_attention(reps, args.length))
    results.update(run_codecs(args.rows or (1024 if args.quick else 4096), 3 if args.quick else 7))
    results.update(bytes_per_token())
    return json_line(results, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
