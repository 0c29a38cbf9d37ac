"""How much prompt a batched step carries (chunked prefill): :class:`PrefillPacer` sizes a step's
prompt chunks by what the loop's steps measured, and :func:`plan_step` picks a step's members.

A long prompt is admitted over several steps beside the sessions that decode, so their streams keep
flowing; a short one (a new turn's few hundred tokens on top of a resident history) is admitted whole,
up to ``WHOLE_PROMPT_TOKENS`` of them a step, so its first token does not wait for the others' paced
chunks; a step in which no session decodes takes up to ``IDLE_PREFILL_TOKENS`` of a long prompt.
"""
from __future__ import annotations

from typing import Protocol, TypeVar

import numpy as np

MAX_PREFILL_TOKENS = 32  # prompt tokens one step carries beside the decode tokens (bench.serve measures the choice)
IDLE_PREFILL_TOKENS = 2048  # prompt tokens one step carries when no session in it decodes: no stream to keep flowing
PREFILL_STEP_RATIO = 3  # a step carrying prompt chunks beside decoding sessions is sized to take at
# most this many times their decode-only step (so a running stream's longest gap stays near it)
PROBE_TOKENS = 4  # prompt tokens of a step beside decoding sessions before a prompt token has been measured
# beside them: a probe that costs about what 4 decode rows do, whatever the prompt's length
WHOLE_PROMPT_TOKENS = 256  # prompt tokens of short prompts (each at most this long, not yet begun) one step
# takes whole, in arrival order, besides the pacer's chunks: a decoding session's gap grows by
# one such prompt's prefill (glm-mini, ~0.2 ms a token: ~50 ms), and a turn's first token no longer waits
# for ~7 paced chunks of 32 behind every other new turn (bench.peer's multi-turn workload: 16 conversations
# of 200-token turns; mean TTFT 1.5 s -> see BENCHMARKS.md). 0: every prompt paced
GROWTH = 2  # a step's prompt tokens beside decoding sessions are at most this many times the last measured


class PrefillPacer:
    """How many prompt tokens a step may carry beside decoding sessions: at most ``cap``, and as
    many as keep the step within ``ratio`` times a decode-only step of those sessions, by what the
    loop's steps measured (a token of prompt costs more the further into a long prompt it is, and
    more than a decode row on a CPU: each position is computed as its own decode step would be).

    Nothing is guessed: until a step has measured prompt tokens beside decoding sessions (a step
    with no one decoding, all prompt, does not tell what one beside them costs), the budget is a
    probe of ``PROBE_TOKENS``; from there it grows at most ``GROWTH`` times a step, as fast as the
    measurements allow, so no chunk can take many decode steps before its cost is known."""

    SMOOTH = 0.3  # weight of the newest measurement in the running estimates

    def __init__(self, cap: int, ratio: float = PREFILL_STEP_RATIO) -> None:
        self.cap, self.ratio = cap, ratio  # ratio 0: no pacing, the cap alone
        self.decode_row_s: float | None = None  # a decode-only step's seconds per session
        self.prompt_token_s: float | None = None  # seconds per prompt token beside decoding sessions
        self.last_prompt = 0  # prompt tokens of the last step measured beside decoding sessions

    def budget(self, decoding: int) -> int:
        """Prompt tokens for a step in which ``decoding`` sessions decode (>= 1)."""
        if not self.ratio:  # off: the cap alone
            return self.cap
        probe = min(self.cap, PROBE_TOKENS)
        if self.decode_row_s is None or self.prompt_token_s is None:  # unmeasured: a probe
            return probe
        grown = min(self.cap, max(probe, GROWTH * self.last_prompt))
        if not self.prompt_token_s:  # too cheap to tell
            return grown
        room = (self.ratio - 1.0) * decoding * self.decode_row_s
        return max(1, min(grown, int(room / self.prompt_token_s)))

    def observe(self, decoding: int, prompt_tokens: int, seconds: float) -> None:
        """One step's size and time."""
        if prompt_tokens == 0:
            self.decode_row_s = self._blend(self.decode_row_s, seconds / max(decoding, 1))
            return
        if decoding == 0:  # all prompt: not what a step beside decoding sessions costs
            return
        decode_part = decoding * (self.decode_row_s or 0.0)
        self.prompt_token_s = self._blend(self.prompt_token_s, max(seconds - decode_part, 0.0) / prompt_tokens)
        self.last_prompt = prompt_tokens

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTH * (new - old)


class Waiting(Protocol):
    """A forward waiting for a step: its tokens [S] i32 and how many of them were stepped."""

    tokens: np.ndarray
    fed: int


W = TypeVar("W", bound=Waiting)


def plan_step(taken: list[W], pacer: PrefillPacer, max_batch: int, max_prefill_tokens: int,
              whole_tokens: int = 0) -> tuple[list[tuple[W, int]], list[W]]:
    """One step's members, each with the tokens it steps (1, a short prompt whole, or a long
    prompt's next chunk), and what waits for a later step: at most ``max_batch`` members, prompts in
    arrival order. Short prompts (at most ``whole_tokens`` tokens, none stepped yet) go whole, up to
    ``whole_tokens`` tokens of them a step (one that does not fit waits for the next step, whole:
    prompts that arrive together get their first tokens one after the other, not all at the end of
    one long step); the others' chunks are, while any member decodes, at most the pacer's budget of
    prompt tokens (at most ``max_prefill_tokens``; the budget keeps the running streams flowing),
    and in a step with no one decoding up to ``IDLE_PREFILL_TOKENS``."""
    batch: list[tuple[W, int]] = []
    later: list[W] = []
    decoding = sum(work.tokens.shape[0] - work.fed == 1 for work in taken)
    budget = pacer.budget(decoding) if decoding else max(max_prefill_tokens, IDLE_PREFILL_TOKENS)
    whole = whole_tokens
    for work in taken:
        want = work.tokens.shape[0] - work.fed
        short = 1 < want <= whole_tokens and work.fed == 0
        take = 1 if want == 1 else (want if want <= whole else 0) if short else min(want, budget)
        if take < 1 or len(batch) >= max_batch:  # a short prompt past this step's whole budget waits whole
            later.append(work)
            continue
        if short:
            whole -= take
        elif want > 1:
            budget -= take
        batch.append((work, take))
    return batch, later


__all__ = ["GROWTH", "IDLE_PREFILL_TOKENS", "MAX_PREFILL_TOKENS", "PREFILL_STEP_RATIO", "PROBE_TOKENS", "PrefillPacer",
           "WHOLE_PROMPT_TOKENS", "Waiting", "plan_step"]
