"""The engine core's scheduling figures for ``bench.serve`` (glm-mini, fp8, real server processes):

- ``ttft16_over_ttft1``: median time to first token of 16 new sessions started at once (read by
  one lean client, the requests sent back to back) / the median of one new session alone.
- ``itl_max_during_long_prefill_over_median``: 4 streams running while a ~1,800-token prompt is
  admitted: the longest gap between two of their tokens / the median gap (over all 4 streams),
  beside the same two figures for the prompt's own time to first token.
- ``batch16_speedup_glm52_layers``: :meth:`MLADecoder.step` of 16 sessions vs of one, in process,
  on a random two-layer checkpoint with GLM-5.2's real layer dims (hidden 6144, q_lora 2048,
  kv_lora 512, rope 64, 64 heads; layer 0 dense, layer 1 MoE with ``GLM52_EXPERTS`` routed experts,
  top-8, one shared expert, the DSA indexer), a small vocabulary: where weights dominate, batching
  must pay.
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import httpx
import numpy as np

from bench.serve_decode import steps_of_one_and_all
from bench.serve_procs import Server, Streamed, stream_completion
from bench.serve_sse import stream_all

LONG_PROMPT = 1800  # tokens of the prompt admitted mid-stream (glm-mini's context is 2048)
RUNNING = 4  # streams running while it is admitted
GLM52_EXPERTS = 16  # routed experts of the MoE layer: 16 x 151 MB of f32 weights fit beside the rest in 24 GiB
GLM52_CONTEXT = 256  # positions each session holds when the step is timed


def _body(model: str, prompt: list[int], max_tokens: int, session: str) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "session": session}


def ttft(s: Streamed) -> float:
    """Seconds from sending the request to its first text event."""
    return s.text_times[0] - s.sent


def bench_ttft(server: Server, prompt: list[int], reps: int, clients: int = 16) -> dict[str, Any]:
    """Median TTFT of ``clients`` new sessions at once / of one new session alone, alternated."""
    model = str(server.call("GET", "/v1/models")["data"][0]["id"])
    one: list[float] = []
    many: list[float] = []
    for rep in range(reps):
        alone = stream_all(server.url, [_body(model, prompt, 4, f"ttft1-{rep}")])[0]
        one.append(ttft(alone))
        streams = stream_all(server.url, [_body(model, prompt, 4, f"ttft16-{rep}-{i}") for i in range(clients)])
        many.append(statistics.median(ttft(s) for s in streams))
    t1, t16 = statistics.median(one), statistics.median(many)
    return {"ttft1_s": t1, "ttft16_s": t16, "ttft16_over_ttft1": t16 / t1,
            "ttft1_all": [round(x * 1e3, 1) for x in one], "ttft16_all": [round(x * 1e3, 1) for x in many]}


def _gaps(s: Streamed) -> list[float]:
    return [b - a for a, b in zip(s.text_times, s.text_times[1:], strict=False)]


def long_prefill_once(server: Server, model: str, prompt: list[int], long_prompt: list[int], tag: str,
                      stream_tokens: int) -> tuple[float, float, float]:
    """One rep: (longest gap, median gap) between the running streams' arrivals, and the long prompt's TTFT."""
    out: dict[str, Any] = {}

    def late() -> None:
        time.sleep(0.3)  # the streams are decoding by then
        with httpx.Client(timeout=600) as client:
            out["long"] = stream_completion(client, server.url, _body(model, long_prompt, 2, f"long-{tag}"))

    thread = threading.Thread(target=late)
    thread.start()
    streams = stream_all(server.url, [_body(model, prompt, stream_tokens, f"run-{tag}-{i}") for i in range(RUNNING)])
    thread.join()
    admitted = out["long"].text_times[0]
    if any(s.text_times[-1] < admitted for s in streams):
        raise RuntimeError("a running stream ended before the long prompt was admitted: raise stream_tokens")
    # gaps between arrivals: events read in one piece share its time, so on a loaded machine a burst's
    # zero gaps (more than half of them, at worst) would make the median 0 and the ratio meaningless
    gaps = [g for s in streams for g in _gaps(s) if g > 0]
    if not gaps:
        raise RuntimeError("every stream's events arrived in one piece: no gap to measure (raise stream_tokens)")
    return max(gaps), statistics.median(gaps), ttft(out["long"])


def bench_long_prefill(server: Server, prompt: list[int], reps: int, stream_tokens: int = 600) -> dict[str, Any]:
    model = str(server.call("GET", "/v1/models")["data"][0]["id"])
    long_prompt = np.random.default_rng(5).integers(10, 3000, LONG_PROMPT).tolist()
    runs = [long_prefill_once(server, model, prompt, long_prompt, str(rep), stream_tokens) for rep in range(reps)]
    ratios = [mx / med for mx, med, _ in runs]
    return {"itl_max_during_long_prefill_over_median": statistics.median(ratios),
            "itl_max_during_long_prefill_s": statistics.median(r[0] for r in runs),
            "itl_median_during_long_prefill_s": statistics.median(r[1] for r in runs),
            "long_prefill_ttft_s": statistics.median(r[2] for r in runs), "long_prompt_tokens": LONG_PROMPT,
            "itl_ratio_all": [round(r, 2) for r in ratios]}


def glm52_layers_config(experts: int = GLM52_EXPERTS) -> dict[str, Any]:
    """GLM-5.2's layer dims on two layers (dense, then MoE), a 4,096-token vocabulary."""
    return {
        "model_type": "glm_moe_dsa", "vocab_size": 4096, "hidden_size": 6144, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 64,
        "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 192, "v_head_dim": 256, "n_routed_experts": experts, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "first_k_dense_replace": 1, "mlp_layer_types": ["dense", "sparse"],
        "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rope_interleave": True, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "eos_token_id": 1, "bos_token_id": 0, "tie_word_embeddings": False,
        "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128, "indexer_types": ["full", "shared"],
    }


def glm52_layers_speedup(reps: int) -> dict[str, Any]:
    """``step`` of 16 sessions at ``GLM52_CONTEXT`` positions vs of one, alternated, medians (the
    sessions resume over one prefill's rows: what a step costs does not depend on their values)."""
    from kernels.model.config import parse_config
    from kernels.model.glm_decoder import GlmDecoder
    from kernels.model.tiny_glm import tiny_glm_weights
    from kernels.model.weights import DictWeights

    t0 = time.perf_counter()
    config = parse_config(glm52_layers_config(), source="bench-glm52-layers")
    model = GlmDecoder(config, DictWeights(tiny_glm_weights(config, 7), source="bench-glm52-layers"))
    built = time.perf_counter() - t0
    rng = np.random.default_rng(3)
    first = model.new_cache("fp8")
    model.forward(rng.integers(2, 4000, GLM52_CONTEXT).astype(np.int32), first)
    blocks = [first.blocks(layer) for layer in range(config.n_layers)]
    caches = [first] + [model.cache_from_blocks(blocks, first.tokens, kv_dtype="fp8", index_rows=first.index_rows())
                        for _ in range(15)]  # the same rows, not copied: each appends its own
    solo, batch = steps_of_one_and_all(model, caches, GLM52_CONTEXT, reps)
    weights = sum(a.nbytes for a in _arrays(model))
    return {"batch16_speedup_glm52_layers": 16 * solo / batch, "glm52_step1_s": solo, "glm52_step16_s": batch,
            "glm52_experts": GLM52_EXPERTS, "glm52_weight_bytes": weights, "glm52_build_s": built}


def _arrays(model: Any) -> list[np.ndarray]:
    """Every distinct weight array the decoder holds (for its size)."""
    seen: dict[int, np.ndarray] = {}

    def walk(obj: Any, depth: int) -> None:
        if isinstance(obj, np.ndarray):
            seen.setdefault(id(obj), obj)
        elif depth < 6 and isinstance(obj, list | tuple):
            for item in obj:
                walk(item, depth + 1)
        elif depth < 6 and isinstance(obj, dict):
            for item in obj.values():
                walk(item, depth + 1)
        elif depth < 6 and hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                walk(item, depth + 1)

    walk(model, 0)
    return list(seen.values())


__all__ = ["bench_long_prefill", "bench_ttft", "glm52_layers_speedup"]
