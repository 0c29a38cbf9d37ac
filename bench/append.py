"""The durable append path against raw I/O on the same bytes, in the same run.

    python -m bench.append [--quick] [--json] [--dir DIR]

(a) stream_append_ratio: GLM-5.2-shaped v2 records (L=78, kv_lora 512, rope 64; codes + scales
    already quantized, as the engine's cache holds them) appended 64 at a time through KVWriter,
    committing every 256 records; vs raw ``os.write`` of 8 MiB chunks of the same bytes + one
    fsync. Throughput ratio (raw time / ours). Goal >= 0.9.
(b) token_commit_ratio: a decode loop, 1 record then a durable commit, repeated, through a
    writer opened as a session's decode loop opens it (``preallocate=None``: zero-filled
    headroom, so token commits overwrite allocated blocks); vs raw ``write`` 45,556 B + fsync +
    4-byte ``pwrite`` + fsync per token. Time ratio (ours / raw), medians of batches; the mean
    and the exact-file writer (``preallocate=0``) are reported too. Goal <= 1.5 (the sidecar
    fsync runs concurrently with the data fsync).
(c) read_ratio: a committed 32k-record v2 file opened through the reader into attention-ready
    per-layer Fp8Rows (zero-copy views, sanitised scales: what resume hands to attention) plus
    one pass touching every committed byte; vs a raw sequential ``readinto`` of the whole file
    into memory. Warm page cache for both (dropping it needs root). Throughput ratio. Goal >= 0.8.
    read_contiguous_ratio (information only): de-interleaving every layer into contiguous arrays.
(d) convert_ratio: ``convert_file`` v1 -> v2 vs ``shutil.copyfile`` of the same v1 file + fsync
    of the copy (convert fsyncs its output). Throughput ratio. Goal >= 0.4.
Medians of several repetitions, both sides timed alternately, each write-side repetition starting
from a clean slate (files removed and ``os.sync()`` outside the timing). Files live in DIR (default: the
system temp dir; it must be a real disk, the script prints which device each path is on).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from bench.report import json_line
from kernels.rows import Fp8Rows, RecordRows
from sessionstore.kvfile import Dims, KVWriter, convert_file, open_kv, pack_records, sanitize_scales

GLM = Dims(n_layers=78, kv_lora=512, qk_rope=64, index_head_dim=0, n_index_layers=0, vocab=154880)
REC_V2 = 45_556
CHUNK = 8 << 20
APPEND_BATCH = 64
COMMIT_EVERY = 256
GOALS = {"stream_append_ratio": (">=", 0.9), "token_commit_ratio": ("<=", 1.5),
         "read_ratio": (">=", 0.8), "convert_ratio": (">=", 0.4)}


def quantized_pool(n: int, seed: int = 0) -> RecordRows:
    """n GLM records of random non-NaN codes and positive scales."""
    rng = np.random.default_rng(seed)
    L = GLM.n_layers

    def codes(w: int) -> np.ndarray:
        return (rng.integers(0, 0x7F, (n, L, w), dtype=np.uint8)
                | (rng.integers(0, 2, (n, L, w), dtype=np.uint8) << 7))  # [n, L, w] u8

    def scales() -> np.ndarray:
        return rng.uniform(1e-3, 1.0, (n, L)).astype(np.float32)  # [n, L] f32

    return RecordRows(tokens=rng.integers(0, GLM.vocab, n).astype(np.int32),
                      lc_codes=codes(GLM.kv_lora), lc_scale=scales(),
                      rc_codes=codes(GLM.qk_rope), rc_scale=scales())


def sliced(rows: RecordRows, start: int, stop: int) -> RecordRows:
    assert rows.lc_codes is not None and rows.lc_scale is not None  # fp8 rows
    assert rows.rc_codes is not None and rows.rc_scale is not None
    return RecordRows(tokens=rows.tokens[start:stop], lc_codes=rows.lc_codes[start:stop],
                      lc_scale=rows.lc_scale[start:stop], rc_codes=rows.rc_codes[start:stop],
                      rc_scale=rows.rc_scale[start:stop])


def fresh(path: str) -> None:
    for p in (path, path + ".colisum", path + ".lock"):
        if os.path.exists(p):
            os.unlink(p)


def paired(base: Callable[[], None], ours: Callable[[], None], reps: int,
           setup: Callable[[], None] | None = None) -> tuple[float, float]:
    """Alternate base and ours ``reps`` times; the two medians (seconds). ``setup`` runs before
    each timed call, outside the timing."""
    tb: list[float] = []
    to: list[float] = []
    for _ in range(reps):
        for fn, sink in ((base, tb), (ours, to)):
            if setup is not None:
                setup()
            started = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - started)
    return statistics.median(tb), statistics.median(to)


# -- (a) streaming append ---------------------------------------------------------------------
def bench_stream(directory: str, n_records: int, reps: int) -> dict:
    pool = quantized_pool(COMMIT_EVERY)
    payload = pack_records(2, GLM, pool).tobytes()  # 256 records of bytes for the raw side
    raw_path, our_path = os.path.join(directory, "raw.bin"), os.path.join(directory, "stream.kv")
    total = n_records * REC_V2

    def clean() -> None:  # both sides start from no file and no dirty pages
        fresh(raw_path)
        fresh(our_path)
        os.sync()

    def raw() -> None:
        fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view, left = memoryview(payload), total
        pos = 0
        while left:
            n = min(CHUNK, left, len(view) - pos)
            os.write(fd, view[pos:pos + n])
            pos = (pos + n) % len(view)
            left -= n
        os.fsync(fd)
        os.close(fd)

    def ours() -> None:
        with KVWriter.open(our_path, GLM) as w:
            for start in range(0, n_records, APPEND_BATCH):
                first = start % COMMIT_EVERY
                w.append(sliced(pool, first, first + APPEND_BATCH))
                if (start + APPEND_BATCH) % COMMIT_EVERY == 0:
                    w.commit()

    raw_t, our_t = paired(raw, ours, reps, setup=clean)
    with open_kv(our_path) as r:
        assert r.nrec == n_records
    return {"stream_append_ratio": raw_t / our_t, "stream_raw_gbps": total / raw_t / 1e9,
            "stream_ours_gbps": total / our_t / 1e9, "stream_records": n_records}


# -- (b) decode-loop commit -------------------------------------------------------------------
def bench_token(directory: str, n_tokens: int, reps: int) -> dict:
    """Both files stay open; batches of BATCH tokens alternate raw / ours (headroom) / ours
    (exact file), so a load change on a shared machine hits all alike; medians of the per-batch
    times (and means: a headroom refill costs one batch now and then)."""
    batch = 10
    pool = quantized_pool(16, seed=1)
    record = pack_records(2, GLM, sliced(pool, 0, 1)).tobytes()
    raw_path = os.path.join(directory, "raw_tok.bin")
    paths = {"ours": os.path.join(directory, "tok.kv"), "exact": os.path.join(directory, "tok0.kv")}
    rows = [sliced(pool, i, i + 1) for i in range(16)]
    for p in (raw_path, *paths.values()):
        fresh(p)
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"\0" * 40)
    writers = {"ours": KVWriter.open(paths["ours"], GLM, preallocate=None),  # a session's setting
               "exact": KVWriter.open(paths["exact"], GLM)}  # default: exact file, no headroom
    raw_n = 0

    def raw() -> None:
        nonlocal raw_n
        for _ in range(batch):
            os.pwrite(fd, record, 40 + raw_n * REC_V2)
            os.fsync(fd)
            raw_n += 1
            os.pwrite(fd, raw_n.to_bytes(4, "little"), 32)
            os.fsync(fd)

    def loop(writer: KVWriter) -> Callable[[], None]:
        def run() -> None:
            for _ in range(batch):
                writer.append(rows[writer.length % 16])
                writer.commit()
        return run

    times: dict[str, list[float]] = {"raw": [], "ours": [], "exact": []}
    fns = {"raw": raw, "ours": loop(writers["ours"]), "exact": loop(writers["exact"])}
    try:
        for fn in fns.values():
            fn()  # warm-up: files created, headroom in place
        for _ in range(max(reps, n_tokens // batch)):
            for name, fn in fns.items():
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
    finally:
        for w in writers.values():
            w.close()
        os.close(fd)
    med = {k: statistics.median(v) / batch for k, v in times.items()}
    mean = {k: statistics.mean(v) / batch for k, v in times.items()}
    return {"token_commit_ratio": med["ours"] / med["raw"], "token_raw_us": med["raw"] * 1e6,
            "token_ours_us": med["ours"] * 1e6, "token_commits": raw_n,
            "token_commit_ratio_mean": mean["ours"] / mean["raw"],
            "token_exact_ratio": med["exact"] / med["raw"],
            "token_exact_ratio_mean": mean["exact"] / mean["raw"]}


# -- (c) read into attention-ready arrays -----------------------------------------------------
def bench_read(directory: str, n_records: int, reps: int) -> dict:
    """read_ratio: zero-copy per-layer Fp8Rows from the reader (what resume hands to attention)
    + one pass touching every committed byte, vs ``readinto`` of the whole file into memory.
    read_contiguous_ratio (information): the same plus de-interleaving every layer into
    contiguous [T, n] code arrays and [T] scales (a gather of 2.5M short rows)."""
    path = os.path.join(directory, "read.kv")
    fresh(path)
    pool = quantized_pool(COMMIT_EVERY, seed=2)
    with KVWriter.open(path, GLM, checksums=False) as w:
        for start in range(0, n_records, COMMIT_EVERY):
            w.append(sliced(pool, 0, min(COMMIT_EVERY, n_records - start)))
    size = os.path.getsize(path)
    raw_buf = bytearray(size)
    scratch = np.empty(CHUNK, np.uint8)  # [8 MiB] u8: the touch pass lands here
    L = GLM.n_layers
    lc = np.empty((L, n_records, GLM.kv_lora), np.uint8)  # [L, T, kv_lora] u8
    rc = np.empty((L, n_records, GLM.qk_rope), np.uint8)  # [L, T, rope] u8
    scales = np.empty((L, 2, n_records), np.float32)  # [L, 2, T] f32

    def raw() -> None:
        with open(path, "rb", buffering=0) as f:
            view, done = memoryview(raw_buf), 0
            while done < size:
                done += f.readinto(view[done:done + CHUNK])

    def views() -> None:
        with open_kv(path, expect=GLM) as reader:
            blocks = reader.layer_blocks()  # per-layer Fp8Rows views, scales sanitised in one pass
            data = np.frombuffer(reader.records_bytes_view(0, reader.nrec), np.uint8)  # [bytes] u8
            for start in range(0, data.shape[0], CHUNK):
                part = data[start:start + CHUNK]
                np.copyto(scratch[:part.shape[0]], part)
            assert len(blocks) == L
            del data, part, blocks

    def contiguous() -> None:
        with open_kv(path, expect=GLM) as reader:
            layers = reader.records["layers"]  # [T, L] structured view
            for b0 in range(0, n_records, 128):  # record blocks: the mapping is read in order
                src = layers[b0:b0 + 128]
                np.copyto(lc[:, b0:b0 + 128].transpose(1, 0, 2), src["lc"])
                np.copyto(rc[:, b0:b0 + 128].transpose(1, 0, 2), src["rc"])
                np.copyto(scales[:, 0, b0:b0 + 128].T, src["lc_scale"])
                np.copyto(scales[:, 1, b0:b0 + 128].T, src["rc_scale"])
            del layers, src
        sanitized = sanitize_scales(scales)  # [L, 2, T] f32
        blocks = [Fp8Rows(lc[i], sanitized[i, 0], rc[i], sanitized[i, 1]) for i in range(L)]
        assert len(blocks) == L

    for warm in (raw, views, contiguous):  # warm the page cache and the destination pages
        warm()
    raw_t, view_t = paired(raw, views, reps)
    raw_t2, cont_t = paired(raw, contiguous, reps)
    fresh(path)
    return {"read_ratio": raw_t / view_t, "read_raw_gbps": size / raw_t / 1e9,
            "read_ours_gbps": size / view_t / 1e9, "read_records": n_records,
            "read_contiguous_ratio": raw_t2 / cont_t, "read_contiguous_gbps": size / cont_t / 1e9}


# -- (d) convert v1 -> v2 vs copy -------------------------------------------------------------
def bench_convert(directory: str, n_records: int, reps: int) -> dict:
    src = os.path.join(directory, "src_v1.kv")
    fresh(src)
    rng = np.random.default_rng(3)
    L = GLM.n_layers
    batch = 64
    with KVWriter.open(src, GLM, kv_dtype="f32", checksums=False) as w:
        lc = rng.standard_normal((batch, L, GLM.kv_lora), dtype=np.float32)  # [b, L, 512] f32
        rc = rng.standard_normal((batch, L, GLM.qk_rope), dtype=np.float32)  # [b, L, 64] f32
        for start in range(0, n_records, batch):
            k = min(batch, n_records - start)
            w.append(RecordRows(tokens=np.arange(k, dtype=np.int32), lc=lc[:k], rc=rc[:k]))
    copy_dst, conv_dst = os.path.join(directory, "copy.kv"), os.path.join(directory, "conv.kv")
    size = os.path.getsize(src)

    def clean() -> None:
        fresh(copy_dst)
        fresh(conv_dst)
        os.sync()

    def copy() -> None:
        shutil.copyfile(src, copy_dst)
        fd = os.open(copy_dst, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def conv() -> None:
        convert_file(src, conv_dst, 2)

    for step in (clean, copy, clean, conv):
        step()
    copy_t, conv_t = paired(copy, conv, reps, setup=clean)
    for p in (src, copy_dst, conv_dst):
        fresh(p)
    return {"convert_ratio": copy_t / conv_t, "convert_copy_gbps": size / copy_t / 1e9,
            "convert_ours_gbps": size / conv_t / 1e9, "convert_records": n_records}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, < 1 minute on 2 cores")
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    parser.add_argument("--dir", default=None, help="where the files go (a real disk)")
    args = parser.parse_args(argv)
    sizes = (dict(stream=2048, token=200, read=32768, convert=1024, reps=5) if args.quick else
             dict(stream=8192, token=1000, read=32768, convert=4096, reps=7))
    base = args.dir or tempfile.gettempdir()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    directory = tempfile.mkdtemp(prefix="coli-bench-append-", dir=base)
    try:
        results: dict = {"quick": args.quick, "dir": directory,
                         "same_device_as_repo": os.stat(directory).st_dev == os.stat(repo).st_dev}
        results.update(bench_stream(directory, sizes["stream"], sizes["reps"]))
        results.update(bench_token(directory, sizes["token"], sizes["reps"]))
        results.update(bench_read(directory, sizes["read"], max(2, sizes["reps"] - 1)))
        results.update(bench_convert(directory, sizes["convert"], sizes["reps"]))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"{'figure':<22}{'ratio':>8}  {'goal':<8} ours vs raw")
    details = {"stream_append_ratio": f"{results['stream_ours_gbps']:.2f} vs "
                                      f"{results['stream_raw_gbps']:.2f} GB/s",
               "token_commit_ratio": f"{results['token_ours_us']:.0f} vs "
                                     f"{results['token_raw_us']:.0f} us/token (mean ratio "
                                     f"{results['token_commit_ratio_mean']:.2f}; exact file "
                                     f"{results['token_exact_ratio']:.2f}, mean "
                                     f"{results['token_exact_ratio_mean']:.2f})",
               "read_ratio": f"{results['read_ours_gbps']:.2f} vs {results['read_raw_gbps']:.2f} GB/s "
                             f"(contiguous copies: {results['read_contiguous_ratio']:.2f}x)",
               "convert_ratio": f"{results['convert_ours_gbps']:.2f} vs "
                                f"{results['convert_copy_gbps']:.2f} GB/s (v1 bytes)"}
    for key, (op, goal) in GOALS.items():
        value = results[key]
        met = value >= goal if op == ">=" else value <= goal
        results[key + "_goal_met"] = met
        print(f"{key:<22}{value:>8.2f}  {op}{goal:<6} {details[key]}{'' if met else '  (goal missed)'}")
    print(f"scratch files were in {directory} (same device as the repo: "
          f"{results['same_device_as_repo']})")
    return json_line(results, args.json)


if __name__ == "__main__":
    sys.exit(main())
