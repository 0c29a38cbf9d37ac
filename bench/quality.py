"""Quality of the quantised latent caches on the trained model (models/glm-mini), against the f32 cache.

    python -m bench.quality [--quick] [--json] [--model models/glm-mini]

On held-out text (the Python documentation topics the model never trained on; training.corpus),
each kv dtype's cache ("f32", "fp8", "int4", "polar4") is filled the way a session fills it: the
first ``PREFIX`` tokens of a window in one forward, the rest one token at a time, so every
prediction reads stored (quantised) rows, and past ``index_topk`` the DSA selection runs over them.
(a) Teacher-forced perplexity per dtype and its relative delta to f32, top-1 agreement with f32's
    argmax, mean KL(f32 || dtype) of the next-token distributions.
(b) Greedy answers (up to an eos) to chat prompts rendered with the checkpoint's template: tokens that
    agree with f32's answer before the first divergence, and how many answers are identical.
(c) Relative L2 error ||decode(encode(x)) - x|| / ||x|| of int4 and polar2..6 on the latent rows
    (Lc [kv_lora], Rc [qk_rope]) the decoder wrote for the held-out text (kernels.tq.TqCodec).
(d) Perplexity by position (f32 cache): held-out windows of the model's whole context (2,048 tokens),
    each prefilled in chunks of ``CHUNK``; the next-token NLL of the predictions at positions
    [lo, hi) of every window, per span of :data:`SPANS`, and the ratio of the last span's to the first's
    (1.0: the model reads a long context as well as a short one). The last span's targets are read again
    with a short context (:func:`short_context_nll`): the text at those positions may be harder in itself,
    and the ratio of the two perplexities is the position's own cost.
JSON keys: ppl_<dtype>, ppl_rel_delta_<dtype>, top1_agree_<dtype>, kl_<dtype>, greedy_prefix_tokens_mean_<dtype>
(tokens agreeing with f32's answer before the first divergence), greedy_prefix_mean_<dtype> (that as a share
of f32's answer), greedy_identical_<dtype>, lc_rel_err_<codec>, rc_rel_err_<codec>, ppl_pos_<lo>_<hi>,
ppl_pos_ratio (last span over first), ppl_pos_last_short_context (the last span's targets read with a
short context), ppl_pos_context_ratio (the last span's perplexity over that), plus tokens/prompts/
position_windows counts.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from kernels.model import GlmDecoder, MLADecoder, Sampler, generate, load_model
from kernels.tq import KV_DTYPES_V3, TqCodec

DTYPES = ("f32", "fp8", "int4", "polar4")
PREFIX = 8
SPANS = ((0, 128), (128, 512), (512, 1024), (1024, 2048))
CHUNK = 256
SHORT_CONTEXT = 128  # (d): the last span's targets read again with at most this many tokens of context
MODEL_DIR = "models/glm-mini"
PROMPTS = (
    [{"role": "user", "content": "Explain the \"for\" statement."}],
    [{"role": "user", "content": "What is the \"with\" statement?"}],
    [{"role": "user", "content": "Tell me about lists."}],
    [{"role": "system", "content": "You answer questions about Python."},
     {"role": "user", "content": "Describe the \"if\" statement."}],
    [{"role": "user", "content": "Explain the \"while\" statement."},
     {"role": "assistant", "content": "The \"while\" statement is used for repeated execution as long as an"
                                      " expression is true."},
     {"role": "user", "content": "What does the manual say about the \"break\" statement?"}],
    [{"role": "user", "content": "What is the \"import\" statement?"}],
)


def load_text_tools(model_dir: str) -> tuple[Any, Any]:
    """(tokenizers.Tokenizer, a render(messages) -> str function) from the checkpoint's files."""
    import jinja2.sandbox
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    template_src = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())["chat_template"]
    template = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        template_src)

    def raise_exception(message: str) -> None:
        raise ValueError(f"{model_dir}: chat template: {message}")

    def render(messages: list[dict[str, str]]) -> str:
        return str(template.render(messages=messages, add_generation_prompt=True, raise_exception=raise_exception))

    return tok, render


def teacher_forced(model: MLADecoder, window: np.ndarray, kv_dtype: str) -> tuple[np.ndarray, Any]:
    """Log-probabilities of every next token of ``window`` [T]: [T-1, V] f32, and the filled cache."""
    cache = model.new_cache(kv_dtype)
    logits = [model.forward(window[:PREFIX], cache)]  # each: [n, V] f32
    for t in range(PREFIX, window.shape[0] - 1):
        logits.append(model.forward(window[t:t + 1], cache))
    lg = np.concatenate(logits).astype(np.float64)  # lg: [T-1, V] f64
    lg -= lg.max(axis=1, keepdims=True)
    return (lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))).astype(np.float32), cache


def run_perplexity(model: MLADecoder, windows: list[np.ndarray]) -> tuple[dict[str, float], list[Any]]:
    out: dict[str, float] = {}
    nll: dict[str, list[float]] = {d: [] for d in DTYPES}
    agree: dict[str, list[bool]] = {d: [] for d in DTYPES}
    kl: dict[str, list[float]] = {d: [] for d in DTYPES}
    f32_caches = []
    for window in windows:
        ref, cache = teacher_forced(model, window, "f32")
        f32_caches.append(cache)
        targets = window[1:]
        for d in DTYPES:
            logp = ref if d == "f32" else teacher_forced(model, window, d)[0]  # logp: [T-1, V] f32
            nll[d] += (-logp[np.arange(targets.size), targets]).tolist()
            agree[d] += (logp.argmax(1) == ref.argmax(1)).tolist()
            kl[d] += (np.exp(ref) * (ref - logp)).sum(1).tolist()
    base = math.exp(statistics.fmean(nll["f32"]))
    print(f"(a) teacher-forced, {len(nll['f32'])} held-out tokens in {len(windows)} windows of {windows[0].size}")
    print(f"    {'dtype':>7} {'ppl':>9} {'rel delta':>10} {'top-1 agree':>12} {'KL':>10}")
    for d in DTYPES:
        ppl = math.exp(statistics.fmean(nll[d]))
        out[f"ppl_{d}"], out[f"ppl_rel_delta_{d}"] = ppl, ppl / base - 1.0
        out[f"top1_agree_{d}"], out[f"kl_{d}"] = statistics.fmean(agree[d]), statistics.fmean(kl[d])
        print(f"    {d:>7} {ppl:9.3f} {ppl / base - 1.0:+10.2%} {out[f'top1_agree_{d}']:12.2%}"
              f" {out[f'kl_{d}']:10.2e}")
    out["heldout_tokens"] = float(len(nll["f32"]))
    return out, f32_caches


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_greedy(model: MLADecoder, tok: Any, render: Any, max_new: int) -> dict[str, float]:
    out: dict[str, float] = {}
    prompts = [tok.encode(render(m)).ids for m in PROMPTS]
    answers = {d: [generate(model, model.new_cache(d), p, max_new, Sampler(), stop_at_eos=True).tokens
                   for p in prompts] for d in DTYPES}
    lengths = [len(p) + len(a) for p, a in zip(prompts, answers["f32"], strict=True)]
    print(f"(b) greedy answers to {len(prompts)} chat prompts (context {min(lengths)}..{max(lengths)} tokens,"
          f" index_topk {getattr(getattr(model, 'dsa', None), 'index_topk', '-')})")
    print(f"    {'dtype':>7} {'tokens before divergence':>25} {'share of f32 answer':>20} {'identical':>10}")
    for d in DTYPES:
        pairs = list(zip(answers[d], answers["f32"], strict=True))
        agreed = [common_prefix(a, r) for a, r in pairs]
        share = statistics.fmean(n / max(len(r), 1) for n, (_, r) in zip(agreed, pairs, strict=True))
        same = sum(a == r for a, r in pairs)
        out[f"greedy_prefix_tokens_mean_{d}"], out[f"greedy_prefix_mean_{d}"] = statistics.fmean(agreed), share
        out[f"greedy_identical_{d}"] = float(same)
        print(f"    {d:>7} {statistics.fmean(agreed):25.1f} {share:20.1%} {same:>8}/{len(prompts)}")
    out["prompts"] = float(len(prompts))
    first = tok.decode(answers["f32"][0], skip_special_tokens=True).strip().replace("\n", " ")
    print(f"    f32 answer to {PROMPTS[0][-1]['content']!r}: {first[:160]!r}")
    return out


def run_row_errors(caches: list[Any]) -> dict[str, float]:
    """Mean relative L2 error per codec on the decoder's own Lc and Rc rows."""
    recs = [c.records_since(0) for c in caches]
    lc = np.concatenate([r.lc.reshape(-1, r.lc.shape[-1]) for r in recs])  # lc: [T*L, kv_lora] f32
    rc = np.concatenate([r.rc.reshape(-1, r.rc.shape[-1]) for r in recs])  # rc: [T*L, qk_rope] f32
    out: dict[str, float] = {}
    print(f"(c) relative L2 error on the decoder's latent rows ({lc.shape[0]} Lc rows of {lc.shape[1]},"
          f" {rc.shape[0]} Rc rows of {rc.shape[1]}): codec, Lc, Rc")
    for name in ("int4", *[k for k in KV_DTYPES_V3 if k != "int4"]):
        codec = TqCodec.from_kv_dtype(name)
        errs = []
        for which, rows in (("lc", lc), ("rc", rc)):
            codes, radius = codec.encode_rows(rows)
            back = codec.decode_rows(codes, radius, rows.shape[1])  # back: [R, n] f32
            norm = np.linalg.norm(rows, axis=1)
            live = norm > 0
            err = float(np.mean(np.linalg.norm(back - rows, axis=1)[live] / norm[live]))
            out[f"{which}_rel_err_{name}"] = err
            errs.append(err)
        print(f"    {name:>7} {errs[0]:.4f} {errs[1]:.4f}")
    return out


def run_positions(model: MLADecoder, windows: list[np.ndarray]) -> dict[str, float]:
    """Perplexity of the f32 cache's predictions per position span of :data:`SPANS` (section (d))."""
    nll = []
    for window in windows:
        cache, inputs = model.new_cache("f32"), window[:-1]
        logits = np.concatenate([model.forward(inputs[i:i + CHUNK], cache)
                                 for i in range(0, inputs.size, CHUNK)]).astype(np.float64)  # [T-1, V] f64
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll.append(-logp[np.arange(inputs.size), window[1:]])  # [T-1] f64: position j predicts token j+1
    rows = np.stack(nll)  # rows: [W, T-1] f64
    out: dict[str, float] = {"position_windows": float(len(windows))}
    print(f"(d) perplexity by position, f32 cache, {len(windows)} held-out windows of {windows[0].size} tokens")
    for lo, hi in SPANS:
        if lo < rows.shape[1]:
            out[f"ppl_pos_{lo}_{hi}"] = math.exp(float(rows[:, lo:hi].mean()))
            print(f"    positions {lo:>5}-{hi:<5} ppl {out[f'ppl_pos_{lo}_{hi}']:9.3f}")
    spans = [k for k in out if k.startswith("ppl_pos_")]
    out["ppl_pos_ratio"] = out[spans[-1]] / out[spans[0]]
    print(f"    last span / first span: {out['ppl_pos_ratio']:.3f}")
    lo, hi = next((lo, hi) for lo, hi in reversed(SPANS) if lo < rows.shape[1])
    short = short_context_nll(model, windows, lo, min(hi, rows.shape[1]))
    out["ppl_pos_last_short_context"] = math.exp(float(short.mean()))
    out["ppl_pos_context_ratio"] = out[spans[-1]] / out["ppl_pos_last_short_context"]
    print(f"    the same {lo}-{hi} targets, each read with {SHORT_CONTEXT // 2}-{SHORT_CONTEXT} tokens of context:"
          f" ppl {out['ppl_pos_last_short_context']:9.3f} (full context / short: {out['ppl_pos_context_ratio']:.3f})")
    return out


def short_context_nll(model: MLADecoder, windows: list[np.ndarray], lo: int, hi: int) -> np.ndarray:
    """NLL [n] f64 of the predictions at positions [lo, hi) of every window, each read with a short context.

    Windows of :data:`SHORT_CONTEXT` tokens at a stride of half that; each scores only its second half, so
    every target is predicted from the SHORT_CONTEXT / 2 .. SHORT_CONTEXT tokens before it, at positions
    under SHORT_CONTEXT, and each position of [lo, hi) is scored once. It tells the text's own difficulty
    from the position's: a model that reads a long context as well as a short one predicts these targets at
    least as well with its full context.
    """
    half = SHORT_CONTEXT // 2
    nll = []
    for window in windows:
        for start in range(max(lo - half + 1, 0), hi - half + 1, half):
            part = window[start:start + SHORT_CONTEXT + 1]  # [<= SHORT_CONTEXT + 1] i32: inputs and the last target
            logits = model.forward(part[:-1], model.new_cache("f32")).astype(np.float64)  # [S, V] f64
            logits -= logits.max(axis=1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
            picked = -logp[np.arange(part.size - 1), part[1:]]  # [S] f64: row j predicts token start + j + 1
            nll.append(picked[half - 1:min(2 * half - 1, hi - start)])  # positions start + half - 1 .. (< hi)
    return np.concatenate(nll)


def heldout_windows(tok: Any, length: int, count: int) -> list[np.ndarray]:
    from training.corpus import load_corpus

    ids = np.asarray(tok.encode(load_corpus().heldout_text).ids, dtype=np.int32)  # ids: [N] i32
    n = min(count, ids.size // length)
    stride = ids.size // max(n, 1)
    return [ids[i * stride:i * stride + length] for i in range(n)]


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="4 windows of 96 tokens and 32 new tokens per answer (else 12 of 192, 48 new)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--model", default=MODEL_DIR)
    p.add_argument("--position-windows", type=int, default=None,
                   help="held-out windows of the full context for (d) (default 2, --quick 1; 0 skips (d))")
    args = p.parse_args(argv)
    model = load_model(args.model)
    if not isinstance(model, GlmDecoder):
        print(f"note: {args.model} is not a glm_moe_dsa model; no DSA selection runs")
    tok, render = load_text_tools(args.model)
    length, count, max_new = (96, 4, 32) if args.quick else (192, 12, 48)
    results, caches = run_perplexity(model, heldout_windows(tok, length, count))
    results.update(run_greedy(model, tok, render, max_new))
    results.update(run_row_errors(caches))
    n_pos = (1 if args.quick else 2) if args.position_windows is None else args.position_windows
    if n_pos:
        context = model.config.max_position_embeddings
        results.update(run_positions(model, heldout_windows(tok, context, n_pos)))
    if args.json:
        print(json.dumps(results, sort_keys=True))
    return results


if __name__ == "__main__":
    main()
