"""Migration throughput and compression, against baselines measured in the same run.

1. ``migrate_ratio``: export + import of a GLM-5.2-shaped (L=78, kv_lora 512, rope 64) v2
   session through a bundle file (every checksum, both fsyncs - the bundle's and the imported
   session's - and the import's verification included) versus ``cp -r`` of the same session
   directory: throughput(migrate) / throughput(cp) = t_cp / (t_export + t_import). Goal >= 0.5.
   Plain ``cp`` does not fsync: its bytes are only in the page cache when it returns, so it
   never waits for the disk, while a migration writes the bytes twice (bundle, then session)
   and makes both durable. Two durable baselines are therefore shown beside it, same bytes,
   same run: ``migrate_vs_cp_fsync`` (``cp -r`` then fsync of every copied file, i.e. `cp` +
   `sync`) and ``migrate_vs_durable_copies`` (two copies of the session written the way import
   writes: write-back started as the bytes land, one fsync per file; the least any durable
   file-to-file migration does). ``two_cps_ratio`` shows the bound: one cp against two plain cps
   (src -> bundle-sized copy -> dst, no fsync, no checksum). Every timed step starts after
   ``os.sync()`` (untimed), so no step pays for an earlier one's write-back; the reps interleave
   the paths; medians of ``--reps``; the source sits in the page cache for all of them.
2. ``zstd_ratio``: raw/zstd size at the bundle's level (``bundle.ZSTD_LEVEL``) of v2 records
   holding rows produced by the reference decoder: GLM-shaped layers (kv_lora 512, rope 64,
   hidden 2048) with seeded random weights fed real text (this repository's source), layers
   >= 1 (layer 0 depends on the token alone and compresses far better: shown apart). Not a
   trained checkpoint: no weights can be downloaded here. Also shown: the embedded tiny model's
   rows and synthetic Gaussian rows, each at levels 1/3/9 with their speeds, which is how the
   level was picked; and what the ``auto`` policy chose for the local file (raw when the disk
   is faster than compression can pay for).

``--quick``: 4096 tokens (186 MB), 5 repetitions: seconds. The full run (32768 tokens, 1.5 GB,
GLM-5.2's long-session size) writes GBs durably: on a VM whose disk sustains far less than its burst rate
(the development VM: ~3 GB/s for the first ~256 MiB of a stream, then ~0.4 GB/s) the durable
paths then measure the disk, not this code.
``--json``: one JSON object as the last line.
"""
from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard

from bench.report import json_line
from kernels.fp8 import quantize_rows
from kernels.rows import RecordRows
from sessionstore.kvfile import Dims, KVWriter, fsync_parent, pack_records
from sessionstore.migration import WritebackFile, export_session, migrate, open_sink
from sessionstore.migration.bundle_format import DEFAULT_CHUNK_BYTES, ZSTD_LEVEL
from sessionstore.sessions import Manifest, ModelRef, SessionStore, session_disk_bytes, write_manifest

GLM = Dims(n_layers=78, kv_lora=512, qk_rope=64, index_head_dim=0, n_index_layers=0, vocab=154880)
BLOCK = 256  # distinct token rows generated, then repeated with new token ids


def build_session(store: SessionStore, sid: str, tokens: int, seed: int = 0) -> None:
    """A v2 session of ``tokens`` records written through the real writer (and its sidecar)."""
    rng = np.random.default_rng(seed)
    chan = np.exp(0.7 * rng.standard_normal(GLM.kv_lora)).astype(np.float32)  # [kv_lora]
    lc = rng.standard_normal((BLOCK, GLM.n_layers, GLM.kv_lora)).astype(np.float32) * chan  # [B, L, 512]
    rc = rng.standard_normal((BLOCK, GLM.n_layers, GLM.qk_rope)).astype(np.float32)  # [B, L, 64]
    lc_codes, lc_scale = quantize_rows(lc)  # [B, L, 512] u8, [B, L] f32
    rc_codes, rc_scale = quantize_rows(rc)  # [B, L, 64] u8, [B, L] f32
    tmp = store.directory.tmp_dir()
    with KVWriter.open(tmp / "kv.coli_kv", GLM, kv_dtype="fp8", staging_bytes=64 << 20) as writer:
        for start in range(0, tokens, BLOCK):
            k = min(BLOCK, tokens - start)
            ids = rng.integers(0, GLM.vocab, size=k, dtype=np.int32)  # [k] i32
            writer.append(RecordRows(tokens=ids, lc_codes=lc_codes[:k], lc_scale=lc_scale[:k],
                                     rc_codes=rc_codes[:k], rc_scale=rc_scale[:k]))
        writer.commit()
    os.unlink(tmp / "kv.coli_kv.lock")
    manifest = Manifest(id=sid, model=ModelRef("glm-shaped", "glm-shaped", "fp1:" + "0" * 64),
                        kv_dtype="fp8", dims=dict(zip(("n_layers", "kv_lora", "qk_rope",
                                                       "index_head_dim", "n_index_layers", "vocab"),
                                                      GLM.as_tuple(), strict=True)), committed=tokens)
    write_manifest(tmp / "manifest.json", manifest)
    store.adopt_dir(tmp, sid)


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def _settle() -> None:
    """Start a timed step with no write-back pending from an earlier one (untimed)."""
    os.sync()


def time_cp(src: Path, dst: Path, *, fsync: bool) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    _settle()
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    if fsync:
        _fsync_tree(dst)
    elapsed = time.perf_counter() - t
    shutil.rmtree(dst)
    return elapsed


def time_two_cps(src: Path, mid: Path, dst: Path) -> float:
    """``cp -r`` twice (src -> mid -> dst), no fsync, no checksum: the bytes written twice, as
    any migration through a file writes them (the bundle, then the imported session)."""
    for p in (mid, dst):
        shutil.rmtree(p, ignore_errors=True)
    _settle()
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(mid)], check=True)
    subprocess.run(["cp", "-r", str(mid), str(dst)], check=True)
    elapsed = time.perf_counter() - t
    for p in (mid, dst):
        shutil.rmtree(p)
    return elapsed


def time_durable_copy(src: Path, dst: Path) -> float:
    """One durable copy of the directory, written the way import writes (4 MiB writes, write-back
    started as they land, fsync per file, fsync of the directory)."""
    shutil.rmtree(dst, ignore_errors=True)
    _settle()
    t = time.perf_counter()
    dst.mkdir()
    outs = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.endswith(".lock"):
            continue
        out = WritebackFile.create(dst / p.name)
        outs.append(out)
        with open(p, "rb") as fh:
            with mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) if p.stat().st_size else (
                    contextlib.nullcontext(b"")) as data:
                view = memoryview(data)
                for i in range(0, len(view), DEFAULT_CHUNK_BYTES):
                    out.write(view[i:i + DEFAULT_CHUNK_BYTES])
                view.release()
    for out in outs:
        out.sync()
        out.close()
    fsync_parent(str(dst / "x"))
    elapsed = time.perf_counter() - t
    shutil.rmtree(dst)
    return elapsed


def time_migrate(a: SessionStore, b: SessionStore, sid: str, bundle: Path) -> tuple[float, float, dict]:
    if b.exists(sid):
        b.delete(sid)
    bundle.unlink(missing_ok=True)
    _settle()
    t = time.perf_counter()
    with open_sink(str(bundle)) as (sink, _):
        exported = export_session(a, sid, sink, compression="auto")
    t_export = time.perf_counter() - t
    t = time.perf_counter()
    with open(bundle, "rb", buffering=1 << 20) as source:
        migrate.import_bundle(b, source, source_name=str(bundle))
    t_import = time.perf_counter() - t
    return t_export, t_import, {"bundle_bytes": bundle.stat().st_size,
                                "zstd_chunks": exported.zstd_chunks, "chunks": exported.chunks}


# --- compression on decoder rows ------------------------------------------------------------
def _text_tokens(n: int) -> np.ndarray:
    root = Path(__file__).resolve().parents[1]
    text = b"".join(p.read_bytes() for p in sorted(root.glob("sessionstore/**/*.py")))
    return np.frombuffer(text[:n], dtype=np.uint8).astype(np.int32)  # [n] byte-level ids


def decoder_records(kind: str, n: int) -> tuple[bytes, bytes]:
    """v2 record bytes of rows the reference decoder produced for ``n`` tokens of real text:
    (layers >= 1, layer 0). Layer 0's latent is a function of the token alone (embedding ->
    kv_a -> norm), so repeated tokens repeat its rows exactly; deeper layers depend on the
    context. A 78-layer model is 77/78 deep rows: the headline ratio uses those."""
    from kernels.model import MLADecoder, load_model, parse_config
    from kernels.model.tiny import tiny_config_dict, tiny_weights
    from kernels.model.weights import DictWeights

    if kind == "tiny":
        model = load_model("tiny")
    else:  # GLM-shaped attention latents: kv_lora 512, rope 64, three dense layers
        cfg_dict = {**tiny_config_dict(), "hidden_size": 2048, "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
                    "q_lora_rank": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
                    "num_hidden_layers": 3, "first_k_dense_replace": 3, "intermediate_size": 256}
        cfg = parse_config(cfg_dict, source="glm-shaped")
        model = MLADecoder(cfg, DictWeights(tiny_weights(cfg, 7), source="glm-shaped"),
                           source="glm-shaped")
    cache = model.new_cache("fp8")
    tokens = _text_tokens(n)
    for start in range(0, n, 128):
        model.forward(tokens[start:start + 128], cache)
    rows = cache.records_since(0)
    dims = Dims(*model.dims_for_file())

    def pack(layers: slice) -> bytes:
        assert rows.lc_codes is not None and rows.lc_scale is not None  # fp8 rows
        assert rows.rc_codes is not None and rows.rc_scale is not None
        part = RecordRows(tokens=rows.tokens, lc_codes=rows.lc_codes[:, layers],
                          lc_scale=rows.lc_scale[:, layers], rc_codes=rows.rc_codes[:, layers],
                          rc_scale=rows.rc_scale[:, layers])
        count = len(range(*layers.indices(dims.n_layers)))
        return pack_records(2, Dims(count, dims.kv_lora, dims.qk_rope, 0, 0, dims.vocab),
                            part).tobytes()

    return pack(slice(1, None)), pack(slice(0, 1))


def synthetic_records(n: int) -> bytes:
    rng = np.random.default_rng(5)
    lc = rng.standard_normal((n, 2, 512)).astype(np.float32)  # [n, 2, 512] f32
    rc = rng.standard_normal((n, 2, 64)).astype(np.float32)  # [n, 2, 64] f32
    dims = Dims(2, 512, 64, 0, 0, 1000)
    rows = RecordRows(tokens=rng.integers(0, 1000, n, dtype=np.int32), lc=lc, rc=rc)
    return pack_records(2, dims, rows).tobytes()


def zstd_profile(raw: bytes, levels=(1, 3, 9), reps: int = 3) -> dict[str, dict[str, float]]:
    """Ratio and median speeds of zstd at each level over ``raw`` cut into bundle chunks."""
    out = {}
    chunk = DEFAULT_CHUNK_BYTES
    pieces = [raw[i:i + chunk] for i in range(0, len(raw), chunk)]
    for level in levels:
        cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        tc, td = [], []
        for _ in range(reps):
            t = time.perf_counter()
            packed = [cctx.compress(p) for p in pieces]
            tc.append(time.perf_counter() - t)
            t = time.perf_counter()
            for p, q in zip(pieces, packed, strict=True):
                dctx.decompress(q, max_output_size=len(p))
            td.append(time.perf_counter() - t)
        stored = sum(min(len(q), len(p)) for p, q in zip(pieces, packed, strict=True))
        out[str(level)] = {"ratio": len(raw) / stored,
                           "compress_mb_s": len(raw) / statistics.median(tc) / 1e6,
                           "decompress_mb_s": len(raw) / statistics.median(td) / 1e6}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4096 tokens (186 MB)")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    ap.add_argument("--tokens", type=int, default=None, help="session length (default 32768)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 5)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args(argv)
    tokens = args.tokens or (4096 if args.quick else 32768)
    reps = args.reps or 5
    scratch = Path(tempfile.mkdtemp(prefix="bench-migrate-", dir=args.dir))
    try:
        a, b = SessionStore(scratch / "A"), SessionStore(scratch / "B")
        t = time.perf_counter()
        build_session(a, "glm", tokens)
        build_s = time.perf_counter() - t
        session_bytes = session_disk_bytes(a.session_dir("glm"))
        src = a.session_dir("glm")
        cp, cp_sync, two_cp, dcopy, runs = [], [], [], [], []
        for _ in range(reps):  # interleaved: slow phases of a shared machine hit every path
            cp.append(time_cp(src, scratch / "cp", fsync=False))
            cp_sync.append(time_cp(src, scratch / "cp", fsync=True))
            two_cp.append(time_two_cps(src, scratch / "cp", scratch / "cp2"))
            dcopy.append(time_durable_copy(src, scratch / "cp"))
            runs.append(time_migrate(a, b, "glm", scratch / "glm.colibundle"))
        t_cp, t_cp_sync = statistics.median(cp), statistics.median(cp_sync)
        t_dcopy, t_two_cp = statistics.median(dcopy), statistics.median(two_cp)
        t_exp = statistics.median(r[0] for r in runs)
        t_imp = statistics.median(r[1] for r in runs)
        t_mig = statistics.median(r[0] + r[1] for r in runs)
        n_rows = 256 if args.quick else 1024
        glm_deep, glm_first = decoder_records("glm", n_rows)
        tiny_deep, _ = decoder_records("tiny", n_rows)
        profiles = {"glm_shaped_decoder": zstd_profile(glm_deep),
                    "glm_shaped_layer0": zstd_profile(glm_first),
                    "tiny_decoder": zstd_profile(tiny_deep),
                    "synthetic_gaussian": zstd_profile(synthetic_records(n_rows))}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    level = str(ZSTD_LEVEL)
    mb = session_bytes / 1e6
    result = {
        "migrate_ratio": round(t_cp / t_mig, 3),
        "zstd_ratio": round(profiles["glm_shaped_decoder"][level]["ratio"], 4),
        "migrate_vs_cp_fsync": round(t_cp_sync / t_mig, 3),
        "migrate_vs_durable_copies": round(2 * t_dcopy / t_mig, 3),
        "two_cps_ratio": round(t_cp / t_two_cp, 3),
        "baseline": "cp -r of the session directory, no fsync (cp_fsync_s: cp -r then fsync of "
                    "every copied file; durable_copy_s: one copy written with streamed "
                    "write-back and fsync, of which a migration makes two)",
        "tokens": tokens, "session_bytes": session_bytes, "reps": reps,
        "cp_s": round(t_cp, 4), "cp_fsync_s": round(t_cp_sync, 4), "two_cps_s": round(t_two_cp, 4),
        "durable_copy_s": round(t_dcopy, 4), "export_s": round(t_exp, 4),
        "import_s": round(t_imp, 4), "migrate_s": round(t_mig, 4),
        "auto_policy": runs[-1][2], "zstd_level": ZSTD_LEVEL,
        "zstd": {k: {lv: {m: round(x, 3) for m, x in v.items()} for lv, v in p.items()}
                 for k, p in profiles.items()},
        "build_s": round(build_s, 2), "quick": bool(args.quick),
    }
    print(f"GLM-5.2-shaped v2 session: {tokens} tokens, {mb:.1f} MB (build {build_s:.1f} s)")
    print(f"{'path':34} {'median s':>9} {'MB/s':>9}")
    for name, secs in (("cp -r (baseline: no fsync)", t_cp), ("cp -r + fsync", t_cp_sync),
                       ("2 x cp -r (bytes written twice)", t_two_cp),
                       ("1 durable copy (streamed fsync)", t_dcopy),
                       ("export -> file (fsynced)", t_exp), ("import <- file (fsynced)", t_imp),
                       ("export + import", t_mig)):
        print(f"{name:34} {secs:9.4f} {mb / secs:9.1f}")
    print(f"migrate_ratio vs plain cp (goal >= 0.5): {result['migrate_ratio']}   vs cp+fsync: "
          f"{result['migrate_vs_cp_fsync']}   vs 2 durable copies: "
          f"{result['migrate_vs_durable_copies']}   auto policy: {runs[-1][2]['zstd_chunks']}/"
          f"{runs[-1][2]['chunks']} chunks zstd")
    print(f"bound: two plain cps (no fsync, no checksum) reach {result['two_cps_ratio']} of one cp's "
          "throughput; a migration through a file writes the bytes twice (bundle, then session), "
          "durably")
    print(f"{'rows':22} {'level':>5} {'ratio':>7} {'comp MB/s':>10} {'decomp MB/s':>12}")
    for kind, prof in profiles.items():
        for lv, v in prof.items():
            print(f"{kind:22} {lv:>5} {v['ratio']:7.4f} {v['compress_mb_s']:10.0f} "
                  f"{v['decompress_mb_s']:12.0f}")
    print(f"zstd_ratio (level {level}, GLM-shaped decoder rows, layers >= 1): {result['zstd_ratio']}")
    return json_line(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
