"""Request bodies of the HTTP API (pydantic), checked against :class:`ServiceLimits`, and the
OpenAI-shaped response objects built from a finished or streaming turn.

Unknown request fields are ignored, as OpenAI-compatible servers do; fields the service cannot
honour (``echo``, ``tools``) are refused by name.
"""
from __future__ import annotations

import secrets
import time
from typing import Any, ClassVar, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from kernels.model.logits import MAX_TOP_LOGPROBS, TokenLogprob
from kernels.model.sampling import BIAS_RANGE, MAX_LOGIT_BIAS, PENALTY_RANGE, PROCESSING
from kernels.model.text import ChatTokenizer
from sessionstore.service.errors import ApiError
from sessionstore.service.http.structured import check_response_format
from sessionstore.service.limits import ServiceLimits

Role = Literal["system", "user", "assistant", "tool", "developer"]


TEXT_PART_SEPARATOR = "\n"  # between the text parts of one message's content (vLLM's choice)


class ChatMessage(BaseModel):
    """One chat message. ``content`` is a string or a list of text parts (``{"type": "text",
    "text": ...}``); it may be null only on an assistant message with ``tool_calls``. Other
    fields (``tool_calls``, ``tool_call_id``, ``name``) are kept for the chat template."""

    model_config = ConfigDict(extra="allow")
    role: Role
    content: str | list[Any] | None = None

    def to_dict(self, where: str) -> dict[str, Any]:
        """The message as the template renders it: ``developer`` as ``system``, text parts
        joined into one string, null extra fields dropped; anything else is a 400 naming ``where``."""
        role = "system" if self.role == "developer" else self.role
        extra = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        tool_calls = extra.get("tool_calls")
        if tool_calls is not None and (role != "assistant" or not isinstance(tool_calls, list)):
            raise ApiError(400, f"{where}.tool_calls: only an assistant message may carry tool_calls, as a list",
                           param=f"{where}.tool_calls")
        content = self.content
        if content is None:
            if tool_calls is None:
                raise ApiError(400, f"{where}.content: a message needs content (null only on an assistant "
                               "message with tool_calls)", param=f"{where}.content")
            content = ""
        elif isinstance(content, list):
            content = TEXT_PART_SEPARATOR.join(text_part(part, f"{where}.content.{j}")
                                               for j, part in enumerate(content))
        return {"role": role, "content": content, **extra}


def text_part(part: Any, where: str) -> str:
    """The text of one content part; a part of any other type is a 400 naming it."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind != "text":
        shown = repr(kind)[:40] if isinstance(kind, str) else "no type"
        raise ApiError(400, f"{where}: content parts of type {shown} are not supported; this model takes "
                       'text only ({"type": "text", "text": ...})', param=f"{where}.type",
                       code="unsupported_content")
    text = part.get("text")
    if not isinstance(text, str):
        raise ApiError(400, f"{where}.text: a text part needs a string 'text'", param=f"{where}.text")
    return text


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds one final chunk with ``choices: []`` and ``usage``."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class TurnFields(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore")
    shapes: ClassVar[dict[str, str]] = {"stop": "a string or a list of strings",
                                        "messages.*.content": "a string, a list of content parts or null"}
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0, lt=1 << 31)  # extension (vLLM's name); 0: off
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    presence_penalty: float | None = Field(default=None, ge=-PENALTY_RANGE, le=PENALTY_RANGE)
    frequency_penalty: float | None = Field(default=None, ge=-PENALTY_RANGE, le=PENALTY_RANGE)
    repetition_penalty: float | None = Field(default=None, gt=0)  # extension (vLLM's): prompt + output
    logit_bias: dict[str, float] | None = None  # token id (decimal) -> bias in [-100, 100]
    min_tokens: StrictInt | None = Field(default=None, ge=0, lt=1 << 31)  # extension (vLLM's)
    stop: str | list[str] | None = None
    n: int = 1
    session: str | None = None  # the conversation this turn continues (created if absent)
    session_id: str | None = None  # the same, by SGLang's name (both given: the same id, else a 400)
    ignore_eos: bool = False  # extension (vLLM's name): keep sampling past eos ids
    retention_seconds: StrictInt | None = None  # extension: the session's retention (FORMAT.md 5.10; null clears)
    pinned: StrictBool | None = None  # extension: the session is never offloaded or expired (FORMAT.md 5.10)
    tools: Any = None
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}

    def sampling(self) -> dict[str, Any]:
        """The sampling fields this request gave, and its seed: a fresh random one when it gave
        none (so two requests at a temperature above 0 differ, as OpenAI's do)."""
        fields = ("temperature", "top_p", "top_k", *PROCESSING)
        given = {k: getattr(self, k) for k in fields if getattr(self, k) is not None}
        return {**given, "seed": fresh_seed() if self.seed is None else self.seed}

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (OpenAI: only when asked for)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check(self, limits: ServiceLimits, what: str) -> None:
        if not 1 <= self.n <= limits.max_choices:
            raise ApiError(400, f"n must be in [1, {limits.max_choices}], found {self.n}", param="n",
                           code="invalid_value")
        if self.tools is not None:
            raise ApiError(400, "tools are not supported", param="tools")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= limits.max_tokens:
            raise ApiError(400, f"max_tokens must be in [1, {limits.max_tokens}], found {self.max_tokens}",
                           param="max_tokens", code="limit_exceeded")
        if self.logit_bias is not None:
            check_logit_bias(self.logit_bias)
        if self.structured():
            check_response_format(self.response_format or {})
            clash = "ignore_eos" if self.ignore_eos else "min_tokens" if self.min_tokens else None
            if clash is not None:  # both would hold off the eos id that ends the JSON value
                raise ApiError(400, f"response_format {self.structured()} cannot be combined with {clash}",
                               param=clash, code="invalid_value")
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ApiError(400, f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                           param="min_tokens", code="invalid_value")
        stops = self.stops()
        if len(stops) > limits.max_stop or any(not s or len(s) > limits.max_stop_chars for s in stops):
            raise ApiError(400, f"stop: at most {limits.max_stop} non-empty strings of at most "
                           f"{limits.max_stop_chars} characters", param="stop")


    def structured(self) -> str | None:
        """The ``response_format`` type when it constrains the output (json_object, json_schema), else None."""
        kind = (self.response_format or {}).get("type")
        if kind in (None, "text"):
            return None
        if kind not in ("json_object", "json_schema"):
            raise ApiError(400, "response_format.type must be text, json_object or json_schema",
                           param="response_format.type", code="invalid_value")
        return str(kind)

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives each token's log-probability comes with (None: no log-probabilities)."""
        return None


def check_logit_bias(bias: dict[str, float]) -> None:
    """At most 300 entries, each a decimal token id -> a bias in [-100, 100] (ids are checked
    against the model's vocabulary by the caller, which knows it); else a 400 naming the entry."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias",
                       code="limit_exceeded")
    for key, value in bias.items():
        if not (key.isascii() and key.isdecimal() and len(key) <= 10):
            raise ApiError(400, f"logit_bias: key {key[:20]!r} is not a token id", param="logit_bias",
                           code="invalid_value")
        if not -BIAS_RANGE <= value <= BIAS_RANGE:
            raise ApiError(400, f"logit_bias: the bias of token {key} must be in [-100, 100], found {value}",
                           param="logit_bias", code="invalid_value")


def check_top_logprobs(value: int, param: str) -> int:
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{param} must be in [0, {MAX_TOP_LOGPROBS}], found {value}", param=param,
                       code="invalid_value")
    return value


class ChatCompletionRequest(TurnFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = None

    def check(self, limits: ServiceLimits, what: str = "chat") -> None:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        super().check(limits, what)
        if self.top_logprobs is not None:
            check_top_logprobs(self.top_logprobs, "top_logprobs")
            if not self.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if not self.messages:
            raise ApiError(400, "messages is empty: give at least one message", param="messages")
        if len(self.messages) > limits.max_messages:
            raise ApiError(400, f"{len(self.messages)} messages exceed the limit of {limits.max_messages}",
                           param="messages", code="limit_exceeded")

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the chat template renders them (:meth:`ChatMessage.to_dict`)."""
        return [m.to_dict(f"messages.{i}") for i, m in enumerate(self.messages)]


PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"
Prompt = str | list[int]  # one prompt: text, or token ids


class CompletionRequest(TurnFields):
    prompt: Any  # checked by :meth:`prompts` (one message for every shape OpenAI accepts)
    echo: bool = False
    logprobs: StrictInt | None = None  # the legacy API's: how many alternatives per token (0: the token's own only)

    def check(self, limits: ServiceLimits, what: str = "completion") -> None:
        super().check(limits, what)
        if self.logprobs is not None:
            check_top_logprobs(self.logprobs, "logprobs")
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        prompts = self.prompts(limits)
        if len(prompts) > 1 and (self.session is not None or self.session_id is not None):
            raise ApiError(400, f"a session continues one prompt; this request gives {len(prompts)}",
                           param="prompt", code="invalid_value")

    def prompts(self, limits: ServiceLimits) -> list[Prompt]:
        """The request's prompts, in order: a string, a list of strings, a list of token ids or a
        list of token-id lists (OpenAI's four shapes); anything else is a 400 naming the shapes."""
        given = self.prompt
        if isinstance(given, str):
            prompts: list[Prompt] = [given]
        elif not isinstance(given, list) or not given:
            if isinstance(given, list):
                raise ApiError(400, "the prompt is empty", param="prompt")
            raise ApiError(400, f"prompt: must be {PROMPT_SHAPES}", param="prompt", code="invalid_type")
        elif all(isinstance(p, str) for p in given):
            prompts = list(given)
        elif all_token_ids(given):
            prompts = [list(given)]
        elif all(isinstance(p, list) and all_token_ids(p) for p in given):
            prompts = [list(p) for p in given]
        else:
            raise ApiError(400, f"prompt: must be {PROMPT_SHAPES} (token ids: integers in [0, 2^31))",
                           param="prompt", code="invalid_type")
        if len(prompts) > limits.max_prompts:
            raise ApiError(400, f"{len(prompts)} prompts exceed the limit of {limits.max_prompts}", param="prompt",
                           code="limit_exceeded")
        for i, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            if not prompt:
                raise ApiError(400, "the prompt is empty" if len(prompts) == 1 else f"{where} is empty",
                               param=where)
            if isinstance(prompt, list) and len(prompt) > limits.max_prompt_ids:
                raise ApiError(400, f"the prompt's {len(prompt)} token ids exceed the limit of "
                               f"{limits.max_prompt_ids}", param=where, code="limit_exceeded")
        return prompts

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


def is_token_id(value: Any) -> bool:
    """An integer id of any vocabulary (the model checks its own size)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


def all_token_ids(values: list[Any]) -> bool:
    """Each :func:`is_token_id`; plain ints (JSON's) in C passes (types, min, max), not a call per id."""
    if values and set(map(type, values)) == {int}:
        return bool(min(values) >= 0 and max(values) < 1 << 31)
    return all(is_token_id(v) for v in values)


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    new: str
    at: int | None = Field(default=None, ge=0)


class PullRequest(BaseModel):
    """``POST /v1/sessions/{id}/pull``: the origin of the server to pull the session from."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    source: str = Field(alias="from")
    replace: bool = True


# ---- responses ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage``; ``cached_tokens``: the prompt's tokens reused from the session (its
    prefix already in the committed history), not computed again."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None,
               token_ids: list[int] | None = None, logprobs: dict[str, Any] | None = None, index: int = 0,
               **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice], **extra}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None = None,
                     token_ids: list[int] | None = None, logprobs: dict[str, Any] | None = None, index: int = 0,
                     **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], **extra}


LOGPROB_FLOOR = -9999.0  # what a -inf log-probability (a banned token) is written as: JSON has no -inf


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def chat_logprobs(entries: list[TokenLogprob], tok: ChatTokenizer | None) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal": null}``
    (without a tokenizer a token is written ``"token_id:N"``, its bytes those of that text)."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        text, raw = token_text(token, tok)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], tok: ChatTokenizer | None, offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (per token
    a dict text -> logprob of the alternatives and the drawn token, the likelier of two with one text)
    and ``text_offset`` (each token's offset in the completion's text: ``offset`` for the first, then
    the lengths of the tokens' texts)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        text = token_text(e.token, tok)[0]
        top: dict[str, float] = {}
        for t, lp in e.top:  # most likely first: of tokens with the same text the likelier one stays
            top.setdefault(token_text(t, tok)[0], _finite(lp))
        top.setdefault(text, _finite(e.logprob))
        tokens.append(text)
        lps.append(_finite(e.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def token_text(token: int, tok: ChatTokenizer | None) -> tuple[str, bytes]:
    """A token's text and bytes (:meth:`ChatTokenizer.token_text`), ``token_id:N`` without a tokenizer."""
    if tok is None:
        text = f"token_id:{token}"
        return text, text.encode()
    return tok.token_text(token)


def fresh_seed() -> int:
    """A random sampling seed below 2^53 (exact as a JSON number in every client)."""
    return secrets.randbits(53)


def usage_chunk(rid: str, obj: str, model: str, created: int, usage: dict[str, Any]) -> dict[str, Any]:
    """A stream's last chunk when ``stream_options.include_usage`` is set: no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}


def now() -> int:
    return int(time.time())


_SSE_JSON = msgspec.json.Encoder()


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (compact JSON, UTF-8 as it is) and a blank line.
    msgspec encodes a chunk an order of magnitude faster than ``json.dumps`` (a chunk per token
    per stream: the API process's share of every token)."""
    data = obj.encode() if isinstance(obj, str) else _SSE_JSON.encode(obj)
    return b"data: " + data + b"\n\n"


__all__ = ["LOGPROB_FLOOR", "PROMPT_SHAPES", "TEXT_PART_SEPARATOR", "ChatCompletionRequest", "ChatMessage",
           "CompletionRequest", "ForkRequest", "Prompt", "StreamOptions", "TurnFields", "chat_chunk", "chat_logprobs",
           "check_logit_bias", "check_top_logprobs", "completion_chunk", "completion_logprobs", "fresh_seed",
           "all_token_ids", "is_token_id", "now", "sse", "text_part", "token_text", "usage", "usage_chunk"]
