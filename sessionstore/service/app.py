"""The HTTP API (Starlette): OpenAI-compatible completions, the sessions API, health and metrics.

Handlers validate the request, queue its work on the :class:`Engine` and stream what comes back;
every refusal is an OpenAI-shaped error (:mod:`sessionstore.service.errors`).
"""
from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kernels.model.logits import TokenLogprob
from sessionstore.migration.lease import HeldElsewhereError
from sessionstore.service import bundle_pull, bundle_upload
from sessionstore.service.auth import BearerAuth
from sessionstore.service.bundle_pull import PullPolicy
from sessionstore.service.bundles import export_compression, export_stream
from sessionstore.service.engine import Engine
from sessionstore.service.errors import ApiError, Places, api_error_of, server_places
from sessionstore.service.listing import in_window, list_object, page_query, problem_description
from sessionstore.service.messages import session_messages
from sessionstore.service.metrics import TurnClock
from sessionstore.service.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ForkRequest,
    PullRequest,
    TurnFields,
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    now,
    parse_body,
    sse,
    usage,
    usage_chunk,
)
from sessionstore.service.responses import ResponsesRoutes, TurnJob
from sessionstore.service.streams import Event, TurnStream, merged
from sessionstore.service.turns import TurnOutcome, TurnSpec
from sessionstore.service.webpage import WithPage
from sessionstore.sessions import validate_session_id
from sessionstore.sessions.catalogue import CatalogueEntry

Handler = Callable[[Request], Awaitable[Response]]


SESSION_HEADER = "x-session-id"  # names a turn's session beside the body's "session" (FORMAT.md 7.2)


def session_of(body: str | None, header: str | None) -> str | None:
    """The session a turn names: the body's ``session`` or the ``X-Session-Id`` header, checked;
    both given and different is a 400."""
    if header is not None and body is not None and header != body:
        raise ApiError(400, "the X-Session-Id header and the body's session field name different sessions",
                       param="session", code="session_mismatch")
    session = body if body is not None else header
    if session is not None:
        validate_session_id(session)
    return session


def holder_redirect(exc: HeldElsewhereError, request: Request, places: Places) -> Response:
    """Another live host holds the session: a 307 to the same path and query on that host when its
    lease says where it serves (a client or proxy repeats the request there, body and all), else
    the 409 naming it."""
    if exc.holder_url is None:
        return error_response(ApiError(409, str(exc), code="session_held"), places)
    query = f"?{request.url.query}" if request.url.query else ""
    body = ApiError(307, f"{exc}; redirected to the holder", code="session_elsewhere").body(places)
    return JSONResponse(body, status_code=307, headers={"location": exc.holder_url + request.url.path + query})


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


def error_response(err: ApiError, places: Places = ()) -> JSONResponse:
    """``err`` as its status and OpenAI-shaped body (no server path in its message)."""
    return JSONResponse(err.body(places), status_code=err.status)


class Api:
    """The routes over one engine."""

    def __init__(self, engine: Engine, pull: PullPolicy | None = None) -> None:
        self.engine = engine
        self.pull = pull  # the peers POST .../pull may fetch from (None: pulls refused)
        self.limits = engine.limits
        self.model_id = engine.model_ref.name
        tok = engine.runner.tok
        self.places = server_places({"<model dir>": engine.model_source, "<store root>": str(engine.store.root),
                                     "<tokenizer dir>": None if tok is None else tok.source})

    # ---- plumbing ------------------------------------------------------------------------------
    def route(self, name: str, fn: Handler) -> Handler:
        """``fn`` with its errors as API errors and its outcome counted."""
        async def wrapped(request: Request) -> Response:
            try:
                response = await fn(request)
            except HeldElsewhereError as exc:
                response = holder_redirect(exc, request, self.places)
            except Exception as exc:
                response = error_response(api_error_of(exc), self.places)
            self.engine.metrics.requests.labels(name, str(response.status_code)).inc()
            return response
        return wrapped

    async def body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body of {declared} bytes exceeds the limit of {limit}",
                           code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body exceeds the limit of {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")

    def session_id(self, request: Request) -> str:
        sid: str = request.path_params["sid"]
        validate_session_id(sid)
        return sid

    async def engine_call(self, fn: Callable[[], Any], session: str | None = None) -> Any:
        return await asyncio.wrap_future(self.engine.submit(fn, session=session))

    # ---- turns ---------------------------------------------------------------------------------
    def spec_of(self, req: TurnFields, kind: str, header_session: str | None = None) -> TurnSpec:
        """The turn a request asks for; its session is the body's ``session`` or the
        ``X-Session-Id`` header (the one a load balancer routes on; both given and different: 400)."""
        self.check_model(req.model)
        session = session_of(req.session, header_session)
        spec = TurnSpec("chat" if kind == "chat" else "completion", session, max_tokens=req.max_tokens,
                        sampling=req.sampling(), stops=req.stops())
        spec.ignore_eos = req.ignore_eos
        spec.top_logprobs = req.top_logprobs_asked()
        spec.n = req.n
        spec.response_format = req.response_format
        vocab = int(self.engine.model.config.vocab_size)
        outside = [k for k in req.logit_bias or {} if int(k) >= vocab]
        if outside:
            raise ApiError(400, f"logit_bias: token id {outside[0]} is outside the vocabulary ({vocab} ids)",
                           param="logit_bias", code="invalid_value")
        if isinstance(req, ChatCompletionRequest):
            spec.messages = req.message_dicts()
        elif isinstance(req, CompletionRequest):
            spec.prompt = req.prompt
        return spec

    async def start_turn(self, spec: TurnSpec, clock: TurnClock,
                         job: TurnJob | None = None) -> tuple[TurnStream, Event]:
        """Queue one turn holding ``spec.session``; its stream and first event (an error before any
        text is raised). ``job``: what the engine runs with the stream (default:
        :meth:`Engine.run_turn` of ``spec``)."""
        stream = self.queue_turn(spec, job)
        first = await self.receive(stream, clock)
        if first.kind == "error":
            raise first.value
        return stream, first

    async def start_turns(self, spec: TurnSpec, clock: TurnClock) -> list[tuple[TurnStream, Event]]:
        """Queue the request's choices: choice 0 is ``spec`` (on its session), choices 1..n-1 its
        stateless copies (:meth:`TurnSpec.choice`), all queued before any is awaited so that the
        engine steps them together; their streams and first events. An error before any text (of
        any choice) is raised, every other choice cancelled. ``clock`` times choice 0 only."""
        streams: list[TurnStream] = []
        try:
            for i in range(spec.n):
                streams.append(self.queue_turn(spec if i == 0 else spec.choice(i)))
            firsts: list[Event] = []
            for i, stream in enumerate(streams):
                event = await self.receive(stream, clock if i == 0 else None)
                if event.kind == "error":
                    raise event.value
                firsts.append(event)
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        return list(zip(streams, firsts, strict=True))

    def queue_turn(self, spec: TurnSpec, job: TurnJob | None = None) -> TurnStream:
        """Queue one turn (counted waiting, then running); the stream its events come on. ``job``:
        what the engine runs with the stream (default: :meth:`Engine.run_turn` of ``spec``)."""
        stream = TurnStream(asyncio.get_running_loop())
        metrics = self.engine.metrics

        def run() -> TurnOutcome:
            metrics.waiting.dec()
            metrics.running.inc()
            try:
                return job(stream) if job is not None else self.engine.run_turn(spec, stream)
            finally:
                metrics.running.dec()

        metrics.waiting.inc()
        try:
            fut = self.engine.submit(run, session=spec.session, turn=True)
        except BaseException:
            metrics.waiting.dec()
            raise

        def deliver(done: Future[TurnOutcome]) -> None:
            error = done.exception()
            if error is not None:
                stream.fail(error)
            else:
                stream.finish(done.result())

        fut.add_done_callback(deliver)
        return stream

    @staticmethod
    async def receive(stream: TurnStream, clock: TurnClock | None) -> Event:
        """The turn's next event, timed by ``clock`` (None: not timed)."""
        event = await stream.next()
        if clock is None:
            return event
        if event.kind == "text":
            clock.text()
        elif event.kind == "done":
            out: TurnOutcome = event.value
            clock.done(len(out.tokens), out.prompt_tokens, out.reused_prefix)
        return event

    def logprobs_of(self, kind: str, entries: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
        """A choice's (or chunk's) ``logprobs`` in the endpoint's shape; None when not asked for.
        ``offset``: the completion text's length before these tokens (the legacy ``text_offset``)."""
        if entries is None:
            return None
        tok = self.engine.runner.tok
        return chat_logprobs(entries, tok) if kind == "chat" else completion_logprobs(entries, tok, offset)

    def usage_of(self, outcomes: list[TurnOutcome]) -> dict[str, Any]:
        """The request's usage: the prompt (and its cached part) once, the tokens of every choice."""
        first = outcomes[0]
        return usage(first.prompt_tokens, sum(len(out.tokens) for out in outcomes), first.reused_prefix)

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

    async def turn(self, request: Request, kind: str) -> Response:
        clock = TurnClock(self.engine.metrics, time.perf_counter())
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        req = parse_body(await self.body(request), model)
        req.check(self.limits)
        spec = self.spec_of(req, kind, request.headers.get(SESSION_HEADER))
        turns = await self.start_turns(spec, clock)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}"
        created = now()
        if not req.stream:
            outcomes = await self.outcomes(turns, clock)
            choices = [self.choice_of(kind, i, out) for i, out in enumerate(outcomes)]
            obj = "chat.completion" if kind == "chat" else "text_completion"
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": self.model_id,
                                 "choices": choices, "usage": self.usage_of(outcomes),
                                 **self.session_fields(spec, outcomes[0])})
        head = StreamHead(kind, rid, created, req.include_usage())
        return StreamingResponse(self.events(head, spec, turns, clock), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def outcomes(self, turns: list[tuple[TurnStream, Event]], clock: TurnClock) -> list[TurnOutcome]:
        """Every choice's outcome, in index order (an error is raised, the other choices cancelled)."""
        outcomes: list[TurnOutcome] = []
        try:
            for i, (stream, event) in enumerate(turns):
                while event.kind == "text":
                    event = await self.receive(stream, clock if i == 0 else None)
                if event.kind == "error":
                    raise event.value
                outcomes.append(event.value)
        except BaseException:
            for stream, _ in turns:
                stream.cancel()
            raise
        return outcomes

    async def events(self, head: StreamHead, spec: TurnSpec, turns: list[tuple[TurnStream, Event]],
                     clock: TurnClock) -> AsyncIterator[bytes]:
        """The turn's SSE: (chat: a role chunk per choice,) a chunk per piece of text (``index``: its
        choice; the choices' chunks interleave as they come), each choice's final chunk with
        ``finish_reason`` and ``token_ids`` when it ends (choice 0's with the session); with
        ``include_usage`` one more chunk with ``choices: []`` and ``usage`` once every choice has
        ended (every other chunk then has ``usage: null``, as OpenAI's). With log-probabilities
        each chunk carries those of its choice's tokens drawn since its chunk before (the final one
        those of the tokens whose text never went out: eos, a stop string's)."""
        kind, rid, created = head.kind, head.rid, head.created
        no_usage: dict[str, Any] = {"usage": None} if head.include_usage else {}
        sent = [0] * spec.n  # per choice: log-probabilities sent so far
        offset = [0] * spec.n  # per choice: the length of their tokens' texts (the legacy text_offset)

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
                for index in range(spec.n):
                    yield sse(chat_chunk(rid, self.model_id, created, {"role": "assistant", "content": ""},
                                         index=index, **no_usage))
            ended: dict[int, TurnOutcome] = {}  # choice -> its outcome
            failed = False
            async for index, event in merged(turns, lambda i, s: self.receive(s, clock if i == 0 else None)):
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
                yield sse(usage_chunk(rid, head.chunk_object, self.model_id, created, self.usage_of(outcomes)))
            yield sse("[DONE]")
        finally:
            for stream, _ in turns:
                stream.cancel()  # a vanished client ends its turns at the next token (choice 0 commits)

    async def chat_completions(self, request: Request) -> Response:
        return await self.turn(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.turn(request, "completion")

    # ---- models, health, metrics ------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                                         "owned_by": "coli-sessionstore"}]})

    async def healthz(self, request: Request) -> Response:
        if self.engine.stopping.is_set():
            return JSONResponse({"status": "stopping"}, status_code=503)
        fenced = self.engine.fences.listed()  # sessions whose commit failed with an I/O error (FORMAT.md 7)
        if fenced:
            return JSONResponse({"status": "degraded", "model": self.model_id, "fenced": fenced})
        return JSONResponse({"status": "ok", "model": self.model_id})

    async def metrics(self, request: Request) -> Response:
        return Response(self.engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- sessions ------------------------------------------------------------------------------
    def describe(self, sid: str) -> dict[str, Any]:
        info = self.engine.store.info(sid)
        last = self.engine.last_use.get(sid)
        return {"id": sid, "object": "session", "tokens": info.tokens + len(info.pending), "committed": info.tokens,
                "bytes": info.bytes, "kv_dtype": info.kv_dtype, "model": info.model,
                "state": self.engine.state_of(sid),
                "last_use": info.updated_at if last is None else datetime.fromtimestamp(last, UTC).isoformat()}

    async def list_sessions(self, request: Request) -> Response:
        """One page from the store's catalogue (``?limit=N&after=ID&order=asc|desc``, FORMAT.md 7)."""
        query = page_query(request.query_params)
        page = await asyncio.to_thread(self.engine.store.page, query.limit, query.after, query.order)
        data = [self.describe_listed(entry) for entry in page.entries]
        home = self.engine.home
        if home is not None:  # a fleet server: the fleet's sessions too (state "remote" where not current here)
            last_id = data[-1]["id"] if data else None
            fleet = await asyncio.to_thread(home.listing, data)
            data = [d for d in fleet if in_window(str(d["id"]), query, last_id, page.has_more)]
            data.sort(key=lambda d: str(d["id"]), reverse=query.order == "desc")
        return JSONResponse(list_object(data, page.has_more))

    def describe_listed(self, entry: CatalogueEntry) -> dict[str, Any]:
        """A page's entry as ``describe`` gives it; one whose files are gone (or unreadable) as such."""
        if entry.state in ("missing", "unreadable"):
            return problem_description(entry)
        last = self.engine.last_use.get(entry.id)
        return {"id": entry.id, "object": "session", "tokens": entry.tokens, "committed": entry.committed,
                "bytes": entry.bytes, "kv_dtype": entry.kv_dtype, "model": entry.model,
                "state": self.engine.state_of(entry.id),
                "last_use": entry.last_use if last is None else datetime.fromtimestamp(last, UTC).isoformat()}

    async def get_session(self, request: Request) -> Response:
        sid = self.session_id(request)
        if not self.engine.store.exists(sid):
            raise ApiError(404, f"no session {sid!r}", code="session_not_found")
        body = self.describe(sid)
        if request.query_params.get("history") in ("1", "true"):
            body["history"] = self.engine.store.history(sid)
        if request.query_params.get("messages") in ("1", "true"):  # from the committed files: never waits
            body.update(await asyncio.to_thread(session_messages, self.engine, sid))
        return JSONResponse(body)

    async def delete_session(self, request: Request) -> Response:
        sid = self.session_id(request)
        await self.engine_call(lambda: self.engine.delete(sid), session=sid)
        return JSONResponse({"id": sid, "object": "session.deleted", "deleted": True})

    async def fork_session(self, request: Request) -> Response:
        sid = self.session_id(request)
        req: ForkRequest = parse_body(await self.body(request), ForkRequest)
        validate_session_id(req.new)
        await self.engine_call(lambda: self.engine.fork(sid, req.new, req.at), session=sid)
        return JSONResponse(self.describe(req.new))

    async def get_bundle(self, request: Request) -> Response:
        sid = self.session_id(request)
        if not self.engine.store.exists(sid):
            raise ApiError(404, f"no session {sid!r}", code="session_not_found")
        compression = export_compression(request.query_params.get("compress"),
                                         request.client.host if request.client else None)
        body, headers = await export_stream(self.engine, sid, compression)
        return StreamingResponse(body, media_type="application/octet-stream", headers=headers)

    async def pull_bundle(self, request: Request) -> Response:
        sid = self.session_id(request)
        req: PullRequest = parse_body(await self.body(request), PullRequest)
        result = await bundle_pull.pull_bundle(self.engine, sid, req.source, self.pull,
                                               limit=self.limits.max_bundle_bytes, replace=req.replace)
        return JSONResponse({**self.describe(sid), "imported": result})

    async def put_bundle(self, request: Request) -> Response:
        sid = self.session_id(request)
        replace = request.query_params.get("replace", "1") not in ("0", "false")  # ?replace=0: refuse a taken id
        result = await bundle_upload.put_bundle(self.engine, sid, request.stream(),
                                                limit=self.limits.max_bundle_bytes,
                                                declared=request.headers.get("content-length"), replace=replace)
        return JSONResponse({**self.describe(sid), "imported": result})

    async def suspend_session(self, request: Request) -> Response:
        sid = self.session_id(request)
        await self.engine_call(lambda: self.engine.suspend(sid), session=sid)
        return JSONResponse(self.describe(sid))


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = exc.detail if isinstance(exc, HTTPException) else "internal error"
    return error_response(ApiError(status, f"{request.method} {request.url.path}: {message}"))


def build_app(engine: Engine, api_key: str | None = None, pull: PullPolicy | None = None) -> Any:
    """The ASGI application over ``engine`` (bearer auth in front when ``api_key`` is set; the web
    page at ``/`` is served without it; ``pull``: the peers ``POST .../pull`` may fetch from)."""
    api = Api(engine, pull)
    responses = ResponsesRoutes(api)
    r = api.route
    routes = [
        Route("/healthz", r("healthz", api.healthz), methods=["GET"]),
        Route("/metrics", r("metrics", api.metrics), methods=["GET"]),
        Route("/v1/models", r("models", api.models), methods=["GET"]),
        Route("/v1/chat/completions", r("chat", api.chat_completions), methods=["POST"]),
        Route("/v1/completions", r("completions", api.completions), methods=["POST"]),
        Route("/v1/responses", r("responses", responses.create), methods=["POST"]),
        Route("/v1/responses/{rid}", r("response", responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{rid}", r("response_delete", responses.delete), methods=["DELETE"]),
        Route("/v1/responses/{rid}/input_items", r("response_input_items", responses.input_items),
              methods=["GET"]),
        Route("/v1/sessions", r("sessions", api.list_sessions), methods=["GET"]),
        Route("/v1/sessions/{sid}", r("session", api.get_session), methods=["GET"]),
        Route("/v1/sessions/{sid}", r("session_delete", api.delete_session), methods=["DELETE"]),
        Route("/v1/sessions/{sid}/fork", r("session_fork", api.fork_session), methods=["POST"]),
        Route("/v1/sessions/{sid}/bundle", r("bundle_get", api.get_bundle), methods=["GET"]),
        Route("/v1/sessions/{sid}/bundle", r("bundle_put", api.put_bundle), methods=["PUT"]),
        Route("/v1/sessions/{sid}/pull", r("bundle_pull", api.pull_bundle), methods=["POST"]),
        Route("/v1/sessions/{sid}/suspend", r("session_suspend", api.suspend_session), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    return WithPage(BearerAuth(app, api_key))


__all__ = ["Api", "build_app", "error_response"]
