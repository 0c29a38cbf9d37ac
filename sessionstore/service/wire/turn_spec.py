"""What a request asks of one turn (:class:`TurnSpec`, built by the API process, run by the engine
core) and what the turn came to (:class:`TurnOutcome`, sent back): both processes' types, carried
over IPC as msgspec encodes dataclasses (:mod:`sessionstore.service.wire.ipc`)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kernels.model.logits import TokenLogprob
from sessionstore.sessions import TierChange


@dataclass
class TurnSpec:
    """What a request asks of one turn (already checked against the limits)."""

    kind: Literal["chat", "completion"]
    session: str | None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # the fields the request gave (the seed always)
    stops: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int | None = None  # log-probabilities of each drawn token and this many alternatives
    n: int = 1  # choices: 0 is this turn, 1..n-1 its stateless copies (:meth:`choice`), queued beside it
    response_format: dict[str, Any] | None = None  # OpenAI's; json_object / json_schema constrain the draw
    prompt_ids: list[int] | None = None  # the prompt rendered and tokenised (by the API process), once
    tier: TierChange | None = None  # the request's retention_seconds / pinned for its session (FORMAT.md 5.10)

    def choice(self, index: int) -> TurnSpec:
        """Choice ``index`` >= 1: the same prompt and settings, stateless, its seed ``seed + index``."""
        seed = (int(self.sampling.get("seed", 0)) + index) % (1 << 64)
        return replace(self, session=None, sampling={**self.sampling, "seed": seed}, n=1)


@dataclass
class TurnOutcome:
    tokens: list[int]
    text: str
    finish: str  # "stop" (eos or a stop string) | "length" | "abort" (client gone, server stopping)
    prompt_tokens: int
    reused_prefix: int = 0
    committed: int | None = None
    created: bool = False
    logprobs: list[TokenLogprob] | None = None  # one per token, when the turn asked for them


__all__ = ["TurnOutcome", "TurnSpec"]
