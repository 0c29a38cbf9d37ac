"""Does a long conversation stay on topic? Multi-turn chats on the shipped model (models/glm-mini).

    python -m bench.long_chat [--json] [--model models/glm-mini] [--chats 3] [--turns 10] [--max-new 96]

Each chat takes one training topic's sections in page order (the way training.train_glm_mini.Batches builds
its chats), asks about one section a turn ("Explain <section>."), and keeps the model's own greedy replies as
the assistant turns, so turn 10 of a chat reads ~900 tokens of history (turn 16: ~1,400). Every reply is
scored against the manual's paragraph for its section (token F1 of the reply's and the paragraph's token
multisets); the baseline is the same question asked alone in a fresh chat. A model that holds a conversation
answers a late turn as well as a fresh question (``late_over_fresh`` near 1.0); one that cannot read its
history falls apart as the chat grows. Replies are greedy, on an f32 cache (the quantised caches' cost is
bench.quality's).

JSON keys: turn_f1_<k> (mean over chats, k from 1), fresh_f1_mean, early_f1_mean (turns 1..turns/2),
late_f1_mean (the rest), late_over_fresh, context_tokens_max (the longest prompt of the last turns), chats,
turns.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from typing import Any

from bench.quality import MODEL_DIR, load_text_tools
from kernels.model import MLADecoder, Sampler, generate, load_model
from training.corpus import chat_pairs, load_corpus

QUESTION = "Explain {t}."


def token_f1(reply: list[int], reference: list[int]) -> float:
    """F1 of the two token multisets (0.0 when either is empty)."""
    common = sum((Counter(reply) & Counter(reference)).values())
    if not common:
        return 0.0
    precision, recall = common / len(reply), common / len(reference)
    return 2 * precision * recall / (precision + recall)


def topic_chats(chats: int, turns: int) -> list[list[tuple[str, str]]]:
    """The first ``chats`` training topics (sorted by name) with at least ``turns`` sections: their first
    ``turns`` (subject, paragraph) pairs in page order."""
    corpus = load_corpus()
    out = []
    for name in sorted(corpus.train_topics):
        pairs = chat_pairs({name: corpus.train_topics[name]})
        if len(pairs) >= turns:
            out.append(pairs[:turns])
        if len(out) == chats:
            break
    return out


def answer(model: MLADecoder, tok: Any, render: Any, messages: list[dict[str, str]], max_new: int) -> tuple[
        list[int], int]:
    """(greedy reply ids up to an eos, prompt length) for ``messages`` from a fresh f32 cache."""
    prompt = tok.encode(render(messages)).ids
    eos = set(model.config.eos_token_ids)
    ids = generate(model, model.new_cache("f32"), prompt, max_new, Sampler(), stop_at_eos=True).tokens
    return [t for t in ids if t not in eos], len(prompt)


def run(model_dir: str, chats: int, turns: int, max_new: int) -> dict[str, float]:
    model = load_model(model_dir)
    tok, render = load_text_tools(model_dir)
    per_turn: list[list[float]] = [[] for _ in range(turns)]
    fresh: list[float] = []
    longest = 0
    for pairs in topic_chats(chats, turns):
        messages: list[dict[str, str]] = []
        for k, (subject, paragraph) in enumerate(pairs):
            question = {"role": "user", "content": QUESTION.format(t=subject)}
            reference = tok.encode(paragraph).ids
            reply, prompt_len = answer(model, tok, render, [*messages, question], max_new)
            alone = reply if not messages else answer(model, tok, render, [question], max_new)[0]  # turn 1 is alone
            per_turn[k].append(token_f1(reply, reference))
            fresh.append(token_f1(alone, reference))
            if k == turns - 1:
                longest = max(longest, prompt_len)
            messages += [question, {"role": "assistant", "content": tok.decode(reply)}]
    half = turns // 2
    out: dict[str, float] = {f"turn_f1_{k + 1}": statistics.fmean(v) for k, v in enumerate(per_turn)}
    out["fresh_f1_mean"] = statistics.fmean(fresh)
    out["early_f1_mean"] = statistics.fmean(f for v in per_turn[:half] for f in v)
    out["late_f1_mean"] = statistics.fmean(f for v in per_turn[half:] for f in v)
    out["late_over_fresh"] = out["late_f1_mean"] / max(out["fresh_f1_mean"], 1e-9)
    out.update(context_tokens_max=float(longest), chats=float(len(per_turn[0])), turns=float(turns))
    print(f"{len(per_turn[0])} chats of {turns} turns (last prompt up to {longest} tokens), greedy, f32 cache;"
          f" token F1 of each reply with the manual's paragraph")
    print("    turn " + " ".join(f"{k + 1:>5}" for k in range(turns)))
    print("    F1   " + " ".join(f"{out[f'turn_f1_{k + 1}']:5.2f}" for k in range(turns)))
    print(f"    the same questions asked alone: {out['fresh_f1_mean']:.2f}; turns {half + 1}-{turns}:"
          f" {out['late_f1_mean']:.2f} ({out['late_over_fresh']:.2f} of fresh)")
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=MODEL_DIR)
    p.add_argument("--chats", type=int, default=3, help="chats (training topics with >= --turns sections: 3 have 10)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.chats < 1 or args.turns < 2 or args.max_new < 1:
        p.error("--chats and --max-new must be >= 1, --turns >= 2")
    out = run(args.model, args.chats, args.turns, args.max_new)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return out


if __name__ == "__main__":
    main()
