"""The service's named limits, with their documented defaults: what a request may ask (past them it
is refused with a 4xx or a 503) and how much work one engine step takes on."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceLimits:
    """Bounds on what requests may ask of the server, and on one engine step."""

    max_body_bytes: int = 4 << 20  # a request body larger than this: 413
    max_messages: int = 1024  # messages in one chat request: 400
    max_prompt_ids: int = 1 << 16  # token ids in one completion prompt: 400
    default_max_tokens: int = 256  # max_tokens when a request gives none (clamped to the context)
    max_tokens: int = 4096  # the largest max_tokens a request may ask for: 400
    max_stop: int = 4  # stop strings per request: 400
    max_stop_chars: int = 256  # characters in one stop string: 400
    max_choices: int = 8  # choices (n) one request may ask for: 400
    max_prompts: int = 32  # prompts in one completion request (a choice of each, n of each): 400
    max_bundle_bytes: int = 1 << 36  # a bundle uploaded with PUT .../bundle larger than this: 413
    max_queued_turns: int = 256  # turns waiting for the engine; past it new ones get 503
    max_resident: int = 8  # sessions resident at once; the least recently used idle one is suspended
    max_batch: int = 64  # sessions one decode step advances together
    max_prefill_tokens: int = 32  # prompt tokens one step carries beside the decode tokens (chunked prefill)
    prefill_step_ratio: int = 3  # such a step is sized to take at most this many decode-only steps; 0: off
    whole_prompt_tokens: int = 256  # short prompts (each at most this long) a step takes whole beside them; 0: off
    read_timeout_s: int = 30  # a request's headers, a JSON body whole, a gap in any body: past it, cut (408)

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            least = 0 if name in ("prefill_step_ratio", "whole_prompt_tokens") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"service limit {name} must be an integer >= {least}, found {value!r}")
        if self.default_max_tokens > self.max_tokens:
            raise ValueError("default_max_tokens must not exceed max_tokens")


__all__ = ["ServiceLimits"]
