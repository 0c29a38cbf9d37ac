"""What ``/v1/chat/completions`` and ``/v1/completions`` send back, in OpenAI's shapes: the whole
response (:meth:`CompletionOutput.whole`) or its server-sent events as the choices' text arrives
(:meth:`CompletionOutput.events`), with the usage, the log-probabilities asked for and the
``session`` extension (FORMAT.md 7.2)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kernels.model.logits import TokenLogprob
from kernels.model.text import ChatTokenizer
from sessionstore.service.errors import Places, api_error_of
from sessionstore.service.http.core_client import CoreStream
from sessionstore.service.http.protocol import (
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    sse,
    usage,
    usage_chunk,
)
from sessionstore.service.http.streams import Event, merged
from sessionstore.service.wire import TurnOutcome, TurnSpec

Receive = Callable[[int, CoreStream], Awaitable[Event]]  # a choice's next event: (its index, its stream)


@dataclass(frozen=True)
class StreamHead:
    """What every chunk of one streamed turn shares."""

    kind: str  # "chat" | "completion"
    rid: str
    created: int
    include_usage: bool

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"


class CompletionOutput:
    """The responses of one model (``model_id``; ``tokenizer`` spells the log-probabilities' tokens;
    ``places``: the server paths an error's message must not show)."""

    def __init__(self, model_id: str, tokenizer: ChatTokenizer | None, places: Places) -> None:
        self.model_id, self.tokenizer, self.places = model_id, tokenizer, places

    def whole(self, head: StreamHead, spec: TurnSpec, outcomes: list[TurnOutcome]) -> dict[str, Any]:
        """The unstreamed response: every choice, the usage and (a session's turn) the session."""
        kind = head.kind
        choices = [self.choice_of(kind, i, out) for i, out in enumerate(outcomes)]
        obj = "chat.completion" if kind == "chat" else "text_completion"
        return {"id": head.rid, "object": obj, "created": head.created, "model": self.model_id, "choices": choices,
                "usage": self.usage_of(outcomes, spec.n), **self.session_fields(spec, outcomes[0])}

    def logprobs_of(self, kind: str, entries: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
        """A choice's (or chunk's) ``logprobs`` in the endpoint's shape; None when not asked for.
        ``offset``: the completion text's length before these tokens (the legacy ``text_offset``)."""
        if entries is None:
            return None
        tok = self.tokenizer
        return chat_logprobs(entries, tok) if kind == "chat" else completion_logprobs(entries, tok, offset)

    def usage_of(self, outcomes: list[TurnOutcome], n: int) -> dict[str, Any]:
        """The request's usage: each prompt (and its cached part) once (the first of its ``n``
        choices), the tokens of every choice."""
        prompts = outcomes[::n]
        return usage(sum(out.prompt_tokens for out in prompts), sum(len(out.tokens) for out in outcomes),
                     sum(out.reused_prefix for out in prompts))

    def choice_of(self, kind: str, index: int, out: TurnOutcome) -> dict[str, Any]:
        """One choice of an unstreamed response."""
        logprobs = self.logprobs_of(kind, out.logprobs)
        if kind == "chat":
            return {"index": index, "message": {"role": "assistant", "content": out.text},
                    "finish_reason": out.finish, "logprobs": logprobs, "token_ids": out.tokens}
        return {"index": index, "text": out.text, "finish_reason": out.finish, "logprobs": logprobs,
                "token_ids": out.tokens}

    def session_fields(self, spec: TurnSpec, out: TurnOutcome) -> dict[str, Any]:
        """The ``session`` extension of a response (nothing for a stateless turn)."""
        if spec.session is None:
            return {}
        return {"session": {"id": spec.session, "created": out.created, "reused_prefix": out.reused_prefix,
                            "committed": out.committed}}

    async def events(self, head: StreamHead, spec: TurnSpec, turns: list[tuple[CoreStream, Event]],
                     receive: Receive) -> AsyncIterator[bytes]:
        """The turn's SSE: (chat: a role chunk per choice,) a chunk per piece of text (``index``: its
        choice; the choices' chunks interleave as they come), each choice's final chunk with
        ``finish_reason`` and ``token_ids`` when it ends (choice 0's with the session); with
        ``include_usage`` one more chunk with ``choices: []`` and ``usage`` once every choice has
        ended (every other chunk then has ``usage: null``, as OpenAI's). With log-probabilities
        each chunk carries those of its choice's tokens drawn since its chunk before (the final one
        those of the tokens whose text never went out: eos, a stop string's). ``receive``: a choice's
        next event (its index, its stream)."""
        kind, rid, created = head.kind, head.rid, head.created
        no_usage: dict[str, Any] = {"usage": None} if head.include_usage else {}
        sent = [0] * len(turns)  # per choice: log-probabilities sent so far
        offset = [0] * len(turns)  # per choice: the length of their tokens' texts (the legacy text_offset)

        def piece(index: int, text: str, finish: str | None = None, tokens: list[int] | None = None,
                  entries: list[TokenLogprob] | None = None, **extra: Any) -> bytes:
            logprobs = self.logprobs_of(kind, entries, offset[index])
            if entries is not None and logprobs is not None:
                sent[index] += len(entries)
                offset[index] += sum(len(t) for t in logprobs["tokens"]) if kind != "chat" else 0
            if kind == "chat":
                return sse(chat_chunk(rid, self.model_id, created, {"content": text} if text or not finish else {},
                                      finish, tokens, logprobs, index, **extra, **no_usage))
            return sse(completion_chunk(rid, self.model_id, created, text, finish, tokens, logprobs, index, **extra,
                                        **no_usage))

        try:
            if kind == "chat":
                for index in range(len(turns)):
                    yield sse(chat_chunk(rid, self.model_id, created, {"role": "assistant", "content": ""},
                                         index=index, **no_usage))
            ended: dict[int, TurnOutcome] = {}  # choice -> its outcome
            failed = False
            async for index, event in merged(turns, receive):
                if event.kind == "text":
                    yield piece(index, event.value, entries=event.logprobs)
                elif event.kind == "done":
                    out: TurnOutcome = event.value
                    ended[index] = out
                    rest = None if out.logprobs is None else out.logprobs[sent[index]:]
                    yield piece(index, "", out.finish, out.tokens, rest,
                                **(self.session_fields(spec, out) if index == 0 else {}))
                else:
                    yield sse(api_error_of(event.value).body(self.places))
                    failed = True
                    break
            if head.include_usage and not failed:
                outcomes = [ended[i] for i in range(len(turns))]
                yield sse(usage_chunk(rid, head.chunk_object, self.model_id, created, self.usage_of(outcomes, spec.n)))
            yield sse("[DONE]")
        finally:
            for stream, _ in turns:
                stream.cancel()  # a vanished client ends its turns at the next token (choice 0 commits)


__all__ = ["CompletionOutput", "Receive", "StreamHead"]
