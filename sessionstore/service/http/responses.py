"""OpenAI's Responses API over sessions (FORMAT.md 7.6): ``POST /v1/responses``, ``GET`` and
``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A response is a chat turn (:class:`TurnSpec` kind ``"chat"``) over the conversation its chain
holds, the new input items and ``instructions`` (a system message first; never carried over a
chain, as OpenAI's). With ``store`` (the default) the turn runs on the chain's session and its
:class:`ResponseRecord` is written before the response is returned: the first response of a
chain creates a session; a response continuing the newest one of its chain appends to that
session in place; one continuing an older response forks the session at that response's
token count; one whose checkpoint is gone (the session deleted or changed) starts a new
session from the record's messages. Every way gives the tokens a stateless run over the ids the
session holds gives: a stateless chat completion over the same messages where the chain's replies
re-tokenise to the ids they were sampled as (else the replies' ids as sampled, :mod:`chat_splice
<sessionstore.sessions.chat_splice>`). ``store: false`` runs stateless and keeps nothing.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import msgspec
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from sessionstore.service.errors import ApiError, Places, api_error_of
from sessionstore.service.http.core_client import CoreClient, CoreStream
from sessionstore.service.http.items import conversation_of, item_page
from sessionstore.service.http.metrics import HttpMetrics, TurnClock
from sessionstore.service.http.model_body import parse_body
from sessionstore.service.http.protocol import (
    TEXT_PART_SEPARATOR,
    fresh_seed,
    now,
    sse,
)
from sessionstore.service.http.session_key import SESSION_HEADER, session_of
from sessionstore.service.http.streams import Event
from sessionstore.service.http.structured import response_format_of, text_format_of
from sessionstore.service.limits import ServiceLimits
from sessionstore.service.wire import (
    ResponseJob,
    ResponseRecord,
    ResponseRecords,
    TurnSpec,
    chain_session_id,
    conversation_not_found,
    finish_record,
    is_response_id,
    is_session_id,
    new_response_id,
    parse_record,
)

MAX_METADATA_PAIRS = 16  # OpenAI's limits on ``metadata``
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text"})

class TurnHost(Protocol):
    """What the routes use of the API they are part of (:class:`sessionstore.service.http.app.Api`)."""

    @property
    def core(self) -> CoreClient: ...
    @property
    def metrics(self) -> HttpMetrics: ...
    @property
    def records_root(self) -> Path: ...
    @property
    def limits(self) -> ServiceLimits: ...
    @property
    def model_id(self) -> str: ...
    @property
    def places(self) -> Places: ...

    async def body(self, request: Request) -> bytes: ...
    def check_model(self, name: str) -> None: ...
    def render(self, spec: TurnSpec) -> None: ...
    async def start_turn(self, spec: TurnSpec, clock: TurnClock,
                         job: ResponseJob | None = None) -> tuple[CoreStream, Event]: ...
    async def receive(self, stream: CoreStream, clock: TurnClock) -> Event: ...


# ---- the request ------------------------------------------------------------------------------
class InputMessage(BaseModel):
    """One input item: a message whose content is a string or a list of text parts."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Any]

    def text(self, where: str) -> str:
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PART_TYPES:
                shown = repr(kind)[:40] if isinstance(kind, str) else "no type"
                raise ApiError(400, f"{where}.content.{j}: content parts of type {shown} are not supported; "
                               'this model takes text only ({"type": "input_text", "text": ...})',
                               param=f"{where}.content.{j}.type", code="unsupported_content")
            text = part.get("text")
            if not isinstance(text, str):
                raise ApiError(400, f"{where}.content.{j}.text: a text part needs a string 'text'",
                               param=f"{where}.content.{j}.text")
            texts.append(text)
        return TEXT_PART_SEPARATOR.join(texts)


class ResponseRequest(BaseModel):
    """``POST /v1/responses``. Unknown fields are ignored; tools are refused by name."""

    model_config = ConfigDict(extra="ignore")
    shapes: ClassVar[dict[str, str]] = {"input": "a string or a list of message items",
                                        "input.*.content": "a string or a list of content parts"}
    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    metadata: dict[str, str] | None = None
    tools: list[Any] | None = None
    text: Any = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}} (structured.py checks it)
    session: str | None = None  # extension: the session the chain's first response runs on (else a new one)
    session_id: str | None = None  # the same, by SGLang's name
    conversation: str | dict[str, Any] | None = None  # FORMAT.md 7.5: the conversation the turn continues

    def check(self, limits: ServiceLimits) -> None:
        if self.conversation is not None and self.previous_response_id is not None:
            raise ApiError(400, "conversation and previous_response_id cannot be used together",
                           param="conversation", code="invalid_value")
        if self.tools:
            raise ApiError(400, "tools are not supported", param="tools")
        n = self.max_output_tokens
        if n is not None and not 1 <= n <= limits.max_tokens:
            raise ApiError(400, f"max_output_tokens must be in [1, {limits.max_tokens}], found {n}",
                           param="max_output_tokens", code="limit_exceeded")
        if isinstance(self.input, list):
            if not self.input:
                raise ApiError(400, "input is empty: give text or at least one message", param="input")
            if len(self.input) > limits.max_messages:
                raise ApiError(400, f"{len(self.input)} input items exceed the limit of {limits.max_messages}",
                               param="input", code="limit_exceeded")
        check_metadata(self.metadata)

    def sampling(self) -> dict[str, Any]:
        """The sampling fields given, and the seed (a fresh random one when none is given)."""
        given = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v is not None}
        return {**given, "seed": fresh_seed() if self.seed is None else self.seed}

    def items(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(the input items as OpenAI lists them, the messages they add for the chat template)."""
        given = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        return input_items(given, "input")


def input_items(given: list[InputMessage], where: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the messages ``given`` as OpenAI's items, each with a fresh id, the messages they add for the
    chat template); ``where`` names the list in a 400."""
    items, messages = [], []
    for i, m in enumerate(given):
        text = m.text(f"{where}.{i}")
        part = "output_text" if m.role == "assistant" else "input_text"
        items.append({"id": f"msg_{secrets.token_hex(24)}", "type": "message", "role": m.role,
                      "status": "completed", "content": [{"type": part, "text": text}]})
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return items, messages


def check_metadata(meta: dict[str, str] | None) -> None:
    """OpenAI's bounds on ``metadata``; a 400 past them."""
    meta = meta or {}
    if len(meta) > MAX_METADATA_PAIRS or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE
                                             for k, v in meta.items()):
        raise ApiError(400, f"metadata: at most {MAX_METADATA_PAIRS} pairs, keys of at most {MAX_METADATA_KEY} "
                       f"and values of at most {MAX_METADATA_VALUE} characters", param="metadata")


# ---- the response object ---------------------------------------------------------------------
def message_item(record: ResponseRecord, text: str, status: str) -> dict[str, Any]:
    """The response's one output item: an assistant message holding its text (and, as the chat
    API's choices do, the sampled ``token_ids``: an extension)."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": [], "token_ids": record.output_tokens}
    return {"id": "msg_" + record.id.removeprefix("resp_"), "type": "message", "role": "assistant",
            "status": status, "content": [part]}


def response_object(record: ResponseRecord, store: bool, *, status: str | None = None) -> dict[str, Any]:
    """OpenAI's response object for ``record`` (``status`` "in_progress": no output, no usage yet)."""
    status = status or record.status
    done = status != "in_progress"
    reason = record.incomplete_reason
    params = record.params
    return {
        "id": record.id, "object": "response", "created_at": record.created_at, "status": status,
        "background": False, "error": None,
        "incomplete_details": {"reason": reason} if done and status == "incomplete" and reason else None,
        "instructions": record.instructions, "max_output_tokens": params.get("max_output_tokens"),
        "model": record.model,
        "output": [message_item(record, record.output_text, "completed" if status == "completed" else "incomplete")]
        if done else [],
        "parallel_tool_calls": False, "previous_response_id": record.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": store,
        "temperature": params.get("temperature"), "top_p": params.get("top_p"),
        "text": {"format": params.get("text_format") or {"type": "text"}},  # as asked (structured.py)
        "tool_choice": "none", "tools": [], "truncation": "disabled",
        "usage": record.usage if done else None, "user": None, "metadata": record.metadata,
        "seed": params.get("seed"),  # extension: the seed the reply was drawn with
        "conversation": None if record.conversation is None else {"id": record.conversation},
    }


def check_chain_key(key: str | None, store: bool, prev: ResponseRecord | None) -> None:
    """A session key (``session``, ``session_id``, ``X-Session-Id``) on a response names the session
    its chain runs on: it needs ``store`` (a stateless response has none), and beside
    ``previous_response_id`` it must name that response's session (one meaning: a router may send
    the key with every turn of the chain)."""
    if key is None:
        return
    if not store:
        raise ApiError(400, "a session key (session, session_id or X-Session-Id) needs store: true; a response "
                       "with store: false runs on no session", param="store", code="invalid_value")
    if prev is not None and prev.session != key:
        raise ApiError(400, f"previous_response_id continues session {prev.session[:80]!r} and the session key "
                       f"names {key[:80]!r}; give one of them, or the same id", param="previous_response_id",
                       code="session_mismatch")


def response_not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"no response {response_id[:80]!r} (unknown, deleted, or created with store: false)",
                    param=param, code="response_not_found")


# ---- the routes -------------------------------------------------------------------------------
class ResponsesRoutes:
    """The Responses API's handlers over one :class:`TurnHost` and the store's responses directory."""

    def __init__(self, host: TurnHost) -> None:
        self.host = host
        self.records = ResponseRecords(host.records_root)

    async def create(self, request: Request) -> Response:
        host = self.host
        clock = TurnClock(host.metrics, time.perf_counter())
        req: ResponseRequest = parse_body(await host.body(request), ResponseRequest)
        req.check(host.limits)
        host.check_model(req.model)
        prev = None
        if req.previous_response_id is not None:
            prev = await self.read(req.previous_response_id)
            if prev is None:
                raise response_not_found(req.previous_response_id, "previous_response_id")
            if prev.model != req.model:
                raise ApiError(409, f"response {prev.id!r} was made by model {prev.model!r}, not {req.model!r}",
                               param="previous_response_id", code="model_mismatch")
        key = session_of({"session": req.session, "session_id": req.session_id}, request.headers.get(SESSION_HEADER))
        check_chain_key(key, req.store or req.conversation is not None, prev)
        items, added = req.items()
        chain = [*(prev.messages if prev else []), *added]
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        text_format = text_format_of(req.text)
        spec = TurnSpec("chat", None, messages=[*system, *chain], max_tokens=req.max_output_tokens,
                        sampling=req.sampling(), response_format=response_format_of(text_format))
        sampler = spec.sampling
        record = ResponseRecord(
            id=new_response_id(), model=host.model_id, created_at=now(), session="", tokens=0,
            digest="", messages=[], input=items, output_text="", output_tokens=[], status="in_progress",
            incomplete_reason=None, usage={}, instructions=req.instructions,
            previous_response_id=req.previous_response_id, metadata=dict(req.metadata or {}),
            params={"temperature": sampler.get("temperature", 0.0), "top_p": sampler.get("top_p", 1.0),
                    "seed": sampler["seed"], "max_output_tokens": req.max_output_tokens,
                    **({} if text_format["type"] == "text" else {"text_format": text_format})})
        host.render(spec)
        job = None
        conversation = conversation_of(req.conversation)
        if conversation is not None:  # the core puts the conversation's items first (FORMAT.md 7.5)
            if not is_session_id(conversation):
                raise conversation_not_found(conversation)
            if key is not None and key != conversation:  # a conversation id is a session key: one meaning
                raise ApiError(400, f"conversation names {conversation[:80]!r} and the session key names "
                               f"{key[:80]!r}; give one of them, or the same id", param="conversation",
                               code="session_mismatch")
            spec.session = record.conversation = conversation
            job = ResponseJob(msgspec.to_builtins(record), chain, None, conversation=conversation, store=req.store)
        elif req.store:  # the core places the turn on the chain's session and writes the record
            spec.session = prev.session if prev is not None else key or chain_session_id()
            job = ResponseJob(msgspec.to_builtins(record), chain,
                              None if prev is None else msgspec.to_builtins(prev))
        try:
            stream, first = await host.start_turn(spec, clock, job)
        except ApiError as exc:  # the grammar compiler names chat's field: here it is text.format
            if exc.param != "response_format":
                raise
            raise ApiError(exc.status, exc.message.replace("response_format", "text.format", 1), param="text.format",
                           code=exc.code) from None
        if req.stream:
            return StreamingResponse(self.events(record, req.store, stream, first, clock),
                                     media_type="text/event-stream", headers={"cache-control": "no-cache"})
        event = first
        while event.kind == "text":
            event = await host.receive(stream, clock)
        if event.kind == "error":
            raise event.value
        finish_record(record, event.value)
        return JSONResponse(response_object(record, req.store))

    # ---- streaming -------------------------------------------------------------------------------
    async def events(self, record: ResponseRecord, store: bool, stream: CoreStream, first: Event,
                     clock: TurnClock) -> AsyncIterator[bytes]:
        """The response's SSE events as OpenAI sends them, each with ``type`` and ``sequence_number``."""
        seq = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            data = sse({"type": kind, "sequence_number": seq, **fields})
            seq += 1
            return data

        item_id = "msg_" + record.id.removeprefix("resp_")
        at = {"item_id": item_id, "output_index": 0}
        try:
            yield event("response.created", response=response_object(record, store, status="in_progress"))
            yield event("response.in_progress", response=response_object(record, store, status="in_progress"))
            item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            yield event("response.output_item.added", output_index=0, item=item)
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", **at, content_index=0, part=empty)
            text = ""
            ev = first
            while ev.kind == "text":
                text += ev.value
                yield event("response.output_text.delta", **at, content_index=0, delta=ev.value, logprobs=[])
                ev = await self.host.receive(stream, clock)
            if ev.kind == "error":
                error = api_error_of(ev.value).body(self.host.places)["error"]
                yield event("error", code=error["code"], message=error["message"], param=error["param"])
                return
            finish_record(record, ev.value)
            obj = response_object(record, store)
            done_item = obj["output"][0]
            yield event("response.output_text.done", **at, content_index=0, text=record.output_text, logprobs=[])
            yield event("response.content_part.done", **at, content_index=0, part=done_item["content"][0])
            yield event("response.output_item.done", output_index=0, item=done_item)
            kind = "response.completed" if record.status == "completed" else "response.incomplete"
            yield event(kind, response=obj)
        finally:
            stream.cancel()  # a vanished client ends its turn at the next token (it commits)

    # ---- stored responses ------------------------------------------------------------------------
    async def stored(self, request: Request) -> ResponseRecord:
        rid: str = request.path_params["rid"]
        record = await self.read(rid)
        if record is None:
            raise response_not_found(rid)
        return record

    async def read(self, response_id: str) -> ResponseRecord | None:
        """The record ``response_id``: this store's, else (a fleet server) the fleet's, via the core."""
        record = await asyncio.to_thread(self.records.read, response_id)
        if record is None and is_response_id(response_id):
            found = await self.host.core.call("fetch_response", rid=response_id)
            record = None if found is None else parse_record(found, f"response {response_id}")
        return record

    async def retrieve(self, request: Request) -> Response:
        if request.query_params.get("stream") in ("1", "true"):
            raise ApiError(400, "streaming a stored response again is not supported", param="stream")
        return JSONResponse(response_object(await self.stored(request), True))

    async def delete(self, request: Request) -> Response:
        """The record and its copy in its session's list go (in the core, holding the session)."""
        record = await self.stored(request)
        if not await self.host.core.call("delete_response", rid=record.id, sid=record.session):
            raise response_not_found(record.id)
        return JSONResponse({"id": record.id, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        """The input items the response added, as OpenAI's list (``order`` desc by default,
        ``limit`` 1-100 (20), ``after`` an item id)."""
        record = await self.stored(request)
        return JSONResponse(item_page(record.input, request.query_params, "in this response"))

    def handlers(self) -> dict[str, Callable[[Request], Awaitable[Response]]]:
        return {"create": self.create, "retrieve": self.retrieve, "delete": self.delete,
                "input_items": self.input_items}


__all__ = ["InputMessage", "ResponseRequest", "ResponsesRoutes", "TurnHost", "check_chain_key", "check_metadata",
           "input_items", "message_item", "response_object"]
