"""Reference decoder speed: decode tokens/s on the embedded ``tiny`` model and on one GLM-5.2-shaped layer.

Each figure is the median of several repetitions; every repetition truncates the cache back to
the same prefix and decodes the same number of tokens, so all runs do identical work. The
baseline is the f32 latent cache measured in the same run over the same prefix; the fp8 cache
(codes + per-row scales, quantized before attention) is reported as a ratio to it.

The GLM-5.2-shaped layer: hidden 6144, 64 heads, q_lora 2048, kv_lora 512, rope 64, qk_nope 192,
v_head 256 (random weights), one dense SwiGLU of expert size (2048) as its feed-forward and a
1024-entry vocabulary, so that attention and the MLA projections dominate, over a few hundred
cached positions.

    python -m bench.decoder --quick --json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from bench.report import add_json_flag, json_line
from kernels.model import MLADecoder, load_model, parse_config
from kernels.model.weights import DictWeights

GLM_SHAPE = dict(hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512,
                 qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256)


def glm_layer_config() -> dict:
    return {
        "model_type": "deepseek_v3", "vocab_size": 1024, "num_hidden_layers": 1, "intermediate_size": 2048,
        "num_key_value_heads": 64, "first_k_dense_replace": 1, "n_routed_experts": 0, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "rope_interleave": True, "hidden_act": "silu", "eos_token_id": 1, **GLM_SHAPE,
    }


def random_weights(cfg_dict: dict, seed: int = 0) -> DictWeights:
    """Every tensor of a one-layer checkpoint, filled by tiling a small random pool (values do not
    matter for speed; generating ~200M normals would dominate the benchmark)."""
    cfg = parse_config(cfg_dict, source="glm-layer")
    pool = np.random.default_rng(seed).standard_normal(1 << 20, dtype=np.float32)  # [1M] f32

    def tensor(shape: tuple[int, ...], scale: float) -> np.ndarray:
        return (np.resize(pool, shape) * np.float32(scale)).astype(np.float32)

    h, H, c = cfg.hidden_size, cfg.num_attention_heads, cfg
    q_lora = c.q_lora_rank
    assert q_lora is not None  # GLM_SHAPE sets q_lora_rank
    p = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, h), "lm_head.weight": (c.vocab_size, h),
        p + "self_attn.q_a_proj.weight": (q_lora, h),
        p + "self_attn.q_b_proj.weight": (H * c.qk_head_dim, q_lora),
        p + "self_attn.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, h),
        p + "self_attn.kv_b_proj.weight": (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        p + "self_attn.o_proj.weight": (h, H * c.v_head_dim),
        p + "mlp.gate_proj.weight": (c.intermediate_size, h), p + "mlp.up_proj.weight": (c.intermediate_size, h),
        p + "mlp.down_proj.weight": (h, c.intermediate_size),
    }
    w = {name: tensor(shape, 1.0 / np.sqrt(shape[1])) for name, shape in shapes.items()}
    w["model.embed_tokens.weight"] = tensor((c.vocab_size, h), 1.0)
    for name, n in (("model.norm.weight", h), (p + "input_layernorm.weight", h),
                    (p + "post_attention_layernorm.weight", h), (p + "self_attn.q_a_layernorm.weight", q_lora),
                    (p + "self_attn.kv_a_layernorm.weight", c.kv_lora_rank)):
        w[name] = np.ones(n, np.float32)
    return DictWeights(w, source="glm-layer")


def decode_rate(model: MLADecoder, kv: str, cached: int, steps: int, reps: int) -> dict[str, float]:
    """Median decode tokens/s over ``reps`` runs of ``steps`` greedy steps after ``cached`` positions."""
    vocab = model.config.vocab_size
    prefix = (np.arange(cached) * 7919 % vocab).astype(np.int32)  # [cached] deterministic ids
    cache = model.new_cache(kv)
    t0 = time.perf_counter()
    logits = model.forward(prefix, cache)
    prefill_s = time.perf_counter() - t0
    first = int(np.argmax(logits[-1]))
    rates = []
    for _ in range(reps):
        cache.truncate(cached)
        token = first
        t0 = time.perf_counter()
        for _ in range(steps):
            token = int(np.argmax(model.forward(np.array([token], np.int32), cache)[-1]))
        rates.append(steps / (time.perf_counter() - t0))
    return {"tokens_per_s": statistics.median(rates), "prefill_tokens_per_s": cached / prefill_s,
            "cache_bytes": cache.own_nbytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repetitions (< 1 minute on 2 cores)")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    reps = 3 if args.quick else 5
    tiny_steps, glm_steps = (64, 6) if args.quick else (200, 24)
    glm_cached = 256 if args.quick else 512

    results: dict[str, float | int | str] = {}
    tiny = load_model("tiny")
    tiny_rate: dict[str, float] = {}
    for kv in ("f32", "fp8"):
        r = decode_rate(tiny, kv, cached=32, steps=tiny_steps, reps=reps)
        tiny_rate[kv] = results[f"tiny_decode_tokens_per_s_{kv}"] = round(r["tokens_per_s"], 1)
    results["tiny_fp8_over_f32_ratio"] = round(tiny_rate["fp8"] / tiny_rate["f32"], 3)

    cfg = glm_layer_config()
    glm = MLADecoder(parse_config(cfg, source="glm-layer"), random_weights(cfg))
    glm_rate: dict[str, float] = {}
    for kv in ("f32", "fp8"):
        r = decode_rate(glm, kv, cached=glm_cached, steps=glm_steps, reps=reps)
        glm_rate[kv] = results[f"glm_layer_decode_tokens_per_s_{kv}"] = round(r["tokens_per_s"], 2)
        results[f"glm_layer_prefill_tokens_per_s_{kv}"] = round(r["prefill_tokens_per_s"], 1)
    results["glm_layer_fp8_over_f32_ratio"] = round(glm_rate["fp8"] / glm_rate["f32"], 3)
    results["glm_layer_cached_positions"] = glm_cached
    results["mode"] = "quick" if args.quick else "full"

    print(f"{'model':<28}{'f32 tok/s':>12}{'fp8 tok/s':>12}{'fp8/f32':>10}")
    print(f"{'tiny (decode)':<28}{results['tiny_decode_tokens_per_s_f32']:>12}"
          f"{results['tiny_decode_tokens_per_s_fp8']:>12}{results['tiny_fp8_over_f32_ratio']:>10}")
    print(f"{'GLM-5.2 layer @' + str(glm_cached) + ' (decode)':<28}{results['glm_layer_decode_tokens_per_s_f32']:>12}"
          f"{results['glm_layer_decode_tokens_per_s_fp8']:>12}{results['glm_layer_fp8_over_f32_ratio']:>10}")
    return json_line(results, args.json)


if __name__ == "__main__":
    sys.exit(main())
