"""bench.peer's measures, the same for either server (a bench.peer_servers.Side), and the keys made
from them (ours / llama.cpp, medians over the reps).

Every timed prompt is fresh token ids (seeded per rep and purpose, ids 16..2999: no special token),
so neither server's prompt cache serves it; both servers get the same ids in the same rep.
- solo: one stream, a 7-token prompt, 128 tokens: tokens/s over the request (sent -> final event)
  and its time to first token;
- agg16: 16 such streams at once: all their tokens over first sent -> last final event, and the
  median of their times to first token;
- stall: 4 running streams; once the first has 16 tokens a 1,100-token prompt is admitted: the
  longest gap of a running stream while it is admitted (a gap that overlaps sent -> its first token)
  over the running streams' median gap;
- resume: a session of a 1,100-token prompt suspended, then one new token fed: seconds from asking
  (ours: the request; llama.cpp: ``/slots/0?action=restore`` and then the request) to its first token;
- prefill: a cold 1,100-token prompt: time to its first token.
"""
from __future__ import annotations

import random
import statistics
from typing import Any

from bench.peer_client import Late, Reply, stream_many, stream_one
from bench.peer_servers import Side

SHORT, LONG, TOKENS = 7, 1100, 128
STREAMS, RUNNING = 16, 4


def prompt_ids(seed: str, n: int) -> list[int]:
    """``n`` token ids drawn from ``seed`` (the same on both sides)."""
    rng = random.Random(seed)
    return [rng.randrange(16, 3000) for _ in range(n)]


def stall_ratio(running: list[Reply], admitted: Reply) -> float:
    """The longest gap of a running stream that overlaps the admission (its request sent -> its first
    token) over the median gap of all running streams."""
    window = (admitted.sent, admitted.token_times[0])
    gaps = [(a, b) for reply in running for a, b in reply.gaps()]
    during = [b - a for a, b in gaps if a < window[1] and b > window[0]]
    if not during:
        raise ValueError("no running stream had a gap while the prompt was admitted (they ended before it)")
    return max(during) / statistics.median(b - a for a, b in gaps)


def measure(side: Side, rep: int, stall_reps: int, tokens: int = TOKENS) -> dict[str, float]:
    """One rep of every measure on ``side`` (already warm), streams of ``tokens`` tokens; the raw
    figures, in seconds and tokens/s."""
    solo = stream_one(side.url, side.body(prompt_ids(f"solo{rep}", SHORT), tokens))
    many = stream_many(side.url, [side.body(prompt_ids(f"agg{rep}.{i}", SHORT), tokens) for i in range(STREAMS)])
    stalls = []
    for k in range(stall_reps):
        running = [side.body(prompt_ids(f"run{rep}.{k}.{i}", SHORT), tokens) for i in range(RUNNING)]
        late = Late(side.body(prompt_ids(f"stall{rep}.{k}", LONG), 1))
        *streams, admitted = stream_many(side.url, running, late=late)
        stalls.append(stall_ratio(streams, admitted))
    key = f"peer-resume-{rep}"
    long_prompt = prompt_ids(f"resume{rep}", LONG)
    side.suspend(key, long_prompt)
    resume_s = side.resume(key, long_prompt)
    prefill = stream_one(side.url, side.body(prompt_ids(f"prefill{rep}", LONG), 1))
    span = max(r.done for r in many) - min(r.sent for r in many)
    return {"solo_tok_s": solo.tok_s, "ttft1_s": solo.ttft, "agg16_tok_s": sum(r.n_tokens for r in many) / span,
            "ttft16_s": statistics.median(r.ttft for r in many), "stall": statistics.median(stalls),
            "resume_s": resume_s, "prefill_s": prefill.ttft}


RATIO_KEYS = {  # key -> the raw figure it divides (ours / llama.cpp)
    "peer_solo_tok_s_ratio": "solo_tok_s", "peer_agg16_tok_s_ratio": "agg16_tok_s",
    "peer_ttft1_ratio": "ttft1_s", "peer_ttft16_ratio": "ttft16_s", "peer_stall_ratio": "stall",
    "peer_resume_ratio": "resume_s", "peer_prefill_ratio": "prefill_s",
}


def medians(reps: list[dict[str, float]]) -> dict[str, float]:
    """Each raw figure's median over the reps."""
    return {name: statistics.median(r[name] for r in reps) for name in reps[0]}


def ratio_keys(ours: list[dict[str, float]], theirs: list[dict[str, float]]) -> dict[str, Any]:
    """The bench's keys (ours / llama.cpp of the medians) and both sides' medians."""
    a, b = medians(ours), medians(theirs)
    out: dict[str, Any] = {key: a[raw] / b[raw] for key, raw in RATIO_KEYS.items()}
    out["ours"], out["llama_cpp"] = a, b
    return out


def greedy_prompts(n: int = 12) -> list[list[int]]:
    """The greedy comparison's prompts: lengths 4..180, fixed ids."""
    return [prompt_ids(f"greedy{i}", 4 + i * 16) for i in range(n)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where ``a`` and ``b`` differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_keys(prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """``peer_greedy_equal`` (prompts whose continuations agree to the end) and, per prompt, its
    length and the first differing token's index in the continuation and in the context (None: agreed)."""
    firsts = [first_difference(a, b) for a, b in zip(ours, theirs, strict=True)]
    return {"peer_greedy_equal": sum(f is None for f in firsts), "peer_greedy_prompts": len(prompts),
            "peer_greedy_first_difference": firsts, "peer_greedy_prompt_lengths": [len(p) for p in prompts],
            "peer_greedy_first_difference_position": [None if f is None else len(p) + f  # in the context
                                                      for p, f in zip(prompts, firsts, strict=True)]}


__all__ = ["LONG", "RATIO_KEYS", "SHORT", "TOKENS", "first_difference", "greedy_keys", "greedy_prompts",
           "measure", "medians", "prompt_ids", "ratio_keys", "stall_ratio"]
