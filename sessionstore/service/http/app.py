"""The HTTP API (Starlette) of the API process: OpenAI-compatible completions, the Responses API,
the sessions API, health and metrics.

Handlers validate the request, render and tokenise its prompt, send its work to the engine core
(:class:`~sessionstore.service.http.core_client.CoreClient`) and stream what comes back
(:mod:`.completion_output` shapes it); every refusal is an OpenAI-shaped error
(:mod:`sessionstore.service.errors`). The sessions API's routes are :mod:`.session_routes`', the
Responses API's :mod:`.responses`'; :func:`build_app` puts them all on one application. Nothing
here touches a session's files (a bundle's transfer is the fleet room's, its install the core's).
"""
from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kernels.model.text import ChatTokenizer
from sessionstore.service.errors import ApiError, Places, api_error_of, server_places
from sessionstore.service.fleet.bundle_pull import PullPolicy
from sessionstore.service.fleet.proxy import FleetProxy
from sessionstore.service.http.auth import BearerAuth
from sessionstore.service.http.completion_output import CompletionOutput, StreamHead
from sessionstore.service.http.conversations import ConversationRoutes
from sessionstore.service.http.core_client import CoreClient, CoreStream, HeldElsewhere
from sessionstore.service.http.metrics import HttpMetrics, TurnClock
from sessionstore.service.http.model_body import parse_body
from sessionstore.service.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TurnFields,
    now,
)
from sessionstore.service.http.responses import ResponsesRoutes
from sessionstore.service.http.session_key import SESSION_HEADER, session_of
from sessionstore.service.http.session_routes import SessionRoutes
from sessionstore.service.http.streams import Event
from sessionstore.service.http.tier_routes import patch_session, tier_change_of
from sessionstore.service.http.webpage import WithPage
from sessionstore.service.limits import ServiceLimits
from sessionstore.service.wire import PromptRenderer, ResponseJob, TurnOutcome, TurnSpec
from sessionstore.sessions import SessionStore, validate_session_id

Handler = Callable[[Request], Awaitable[Response]]


def holder_redirect(exc: HeldElsewhere, request: Request, places: Places) -> Response:
    """Another live host holds the session: a 307 to the same path and query on that host when its
    lease says where it serves (a client or proxy repeats the request there, body and all), else
    the 409 naming it."""
    if exc.holder_url is None:
        return error_response(exc, places)
    query = f"?{request.url.query}" if request.url.query else ""
    body = ApiError(307, f"{exc}; redirected to the holder", code="session_elsewhere").body(places)
    return JSONResponse(body, status_code=307, headers={"location": exc.holder_url + request.url.path + query})


def error_response(err: ApiError, places: Places = ()) -> JSONResponse:
    """``err`` as its status and OpenAI-shaped body (no server path in its message)."""
    return JSONResponse(err.body(places), status_code=err.status)


@dataclass(frozen=True)
class ServerContext:
    """What the routes work with: the engine core's client, the model's name, vocabulary and
    tokenizer, the store (read for bundles' transfer), the limits and the peers a pull may use."""

    core: CoreClient
    model_id: str
    vocab_size: int
    model_source: str
    tokenizer: ChatTokenizer | None
    store: SessionStore
    limits: ServiceLimits
    metrics: HttpMetrics
    pull: PullPolicy | None = None  # the peers POST .../pull may fetch from (None: pulls refused)
    fleet_proxy: FleetProxy | None = None  # --fleet-proxy: forward requests for sessions held elsewhere


class Api:
    """The routes over one engine core."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.core = ctx.core
        self.store = ctx.store
        self.metrics = ctx.metrics
        self.pull = ctx.pull
        self.limits = ctx.limits
        self.model_id = ctx.model_id
        self.tok = ctx.tokenizer
        self.model_source = ctx.model_source
        self.renderer = PromptRenderer(ctx.tokenizer)
        self.body_read_timeout_s = float(ctx.limits.read_timeout_s)
        tok = ctx.tokenizer
        self.places = server_places({"<model dir>": ctx.model_source, "<store root>": str(ctx.store.root),
                                     "<tokenizer dir>": None if tok is None else tok.source})
        self.output = CompletionOutput(ctx.model_id, ctx.tokenizer, self.places)

    # ---- plumbing ------------------------------------------------------------------------------
    def route(self, name: str, fn: Handler) -> Handler:
        """``fn`` with its errors as API errors and its outcome counted."""
        async def wrapped(request: Request) -> Response:
            try:
                response = await fn(request)
            except HeldElsewhere as exc:
                proxy = self.ctx.fleet_proxy
                if proxy is not None and exc.holder_url is not None and proxy.forwardable(request):
                    response = await proxy.forward(request, exc.holder_url)
                else:
                    response = holder_redirect(exc, request, self.places)
            except Exception as exc:
                response = error_response(api_error_of(exc), self.places)
            self.metrics.requests.labels(name, str(response.status_code)).inc()
            return response
        return wrapped

    async def body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body of {declared} bytes exceeds the limit of {limit}",
                           code="body_too_large")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_read_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise ApiError(413, f"the request body exceeds the limit of {limit} bytes",
                                       code="body_too_large")
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_read_timeout_s:.0f} s "
                           f"({size} bytes came)", code="request_timeout") from None
        body = b"".join(chunks)
        request.state.body = body  # kept for --fleet-proxy, which may forward the request
        return body

    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")

    def session_id(self, request: Request) -> str:
        sid: str = request.path_params["sid"]
        validate_session_id(sid)
        return sid

    # ---- turns ---------------------------------------------------------------------------------
    def spec_of(self, req: TurnFields, kind: str, header_session: str | None = None) -> TurnSpec:
        """The turn a request asks for; its session is the body's ``session`` or the
        ``X-Session-Id`` header (the one a load balancer routes on; both given and different: 400)."""
        self.check_model(req.model)
        session = session_of({"session": req.session, "session_id": req.session_id}, header_session)
        spec = TurnSpec("chat" if kind == "chat" else "completion", session, max_tokens=req.max_tokens,
                        sampling=req.sampling(), stops=req.stops())
        spec.ignore_eos = req.ignore_eos
        spec.top_logprobs = req.top_logprobs_asked()
        spec.n = req.n
        spec.response_format = req.response_format
        spec.tier = tier_change_of(req, session)  # retention_seconds / pinned (FORMAT.md 5.10)
        vocab = self.ctx.vocab_size
        outside = [k for k in req.logit_bias or {} if int(k) >= vocab]
        if outside:
            raise ApiError(400, f"logit_bias: token id {outside[0]} is outside the vocabulary ({vocab} ids)",
                           param="logit_bias", code="invalid_value")
        if isinstance(req, ChatCompletionRequest):
            spec.messages = req.message_dicts()
        elif isinstance(req, CompletionRequest):
            spec.prompt = req.prompts(self.limits)[0]
        self.render(spec)
        return spec

    def specs_of(self, req: TurnFields, kind: str, header_session: str | None = None) -> list[TurnSpec]:
        """The turns a request asks for, one per prompt (a completion request may give several; each
        turn's ``n`` choices are queued beside it)."""
        spec = self.spec_of(req, kind, header_session)
        specs = [spec]
        if isinstance(req, CompletionRequest):
            for prompt in req.prompts(self.limits)[1:]:
                more = replace(spec, prompt=prompt, prompt_ids=None)
                self.render(more)
                specs.append(more)
        return specs

    @property
    def records_root(self) -> Path:
        return Path(self.store.root)

    def render(self, spec: TurnSpec) -> None:
        """Render and tokenise ``spec``'s prompt, once, here (the core checks the ids); a completion's
        prompt then travels to the core as its ids alone (not a second copy of a long history)."""
        spec.prompt_ids = self.renderer.prompt_ids(spec.kind, spec.messages, spec.prompt)
        if spec.kind == "completion":
            spec.prompt = None

    async def start_turn(self, spec: TurnSpec, clock: TurnClock,
                         job: ResponseJob | None = None) -> tuple[CoreStream, Event]:
        """Queue one turn holding ``spec.session``; its stream and first event (an error before any
        text is raised). ``job``: the stored response the turn makes (None: a plain turn)."""
        stream = self.queue_turn(spec, job)
        first = await self.receive(stream, clock)
        if first.kind == "error":
            raise first.value
        return stream, first

    async def start_turns(self, specs: list[TurnSpec], clock: TurnClock) -> list[tuple[CoreStream, Event]]:
        """Queue the request's choices: of each prompt's ``spec``, ``spec`` itself (the first on its
        session) and its stateless copies (:meth:`TurnSpec.choice`), choice ``p * n + j`` being copy
        j of prompt p (OpenAI's order), all queued before any is awaited so that the engine steps
        them together; their streams and first events. An error before any text (of any choice) is
        raised, every other choice cancelled. ``clock`` times choice 0 only."""
        streams: list[CoreStream] = []
        try:
            for spec in specs:
                for j in range(spec.n):
                    streams.append(self.queue_turn(spec if j == 0 else spec.choice(j)))
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

    def queue_turn(self, spec: TurnSpec, job: ResponseJob | None = None) -> CoreStream:
        """Send one turn to the core; the stream its events come on."""
        return self.core.turn(spec, job)

    @staticmethod
    async def receive(stream: CoreStream, clock: TurnClock | None) -> Event:
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

    async def turn(self, request: Request, kind: str) -> Response:
        clock = TurnClock(self.metrics, time.perf_counter())
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        req = parse_body(await self.body(request), model)
        req.check(self.limits)
        specs = self.specs_of(req, kind, request.headers.get(SESSION_HEADER))
        spec = specs[0]
        turns = await self.start_turns(specs, clock)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}"
        created = now()
        head = StreamHead(kind, rid, created, req.include_usage())
        if not req.stream:
            return JSONResponse(self.output.whole(head, spec, await self.outcomes(turns, clock)))
        events = self.output.events(head, spec, turns, lambda i, s: self.receive(s, clock if i == 0 else None))
        return StreamingResponse(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})

    async def outcomes(self, turns: list[tuple[CoreStream, Event]], clock: TurnClock) -> list[TurnOutcome]:
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

    async def chat_completions(self, request: Request) -> Response:
        return await self.turn(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.turn(request, "completion")

    # ---- models, health, metrics ------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                                         "owned_by": "coli-sessionstore"}]})

    async def healthz(self, request: Request) -> Response:
        core = self.core
        if core.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        if core.ready is None:
            return JSONResponse({"status": "engine_restarting", "engine_restarts": core.restarts}, status_code=503)
        body = {"status": "ok", "model": self.model_id, "engine_pid": core.pid, "engine_restarts": core.restarts}
        try:  # sessions whose commit failed with an I/O error, fenced (FORMAT.md 7)
            fenced = await core.call("fenced")
        except ApiError:
            fenced = []
        if fenced:
            body.update(status="degraded", fenced=fenced)
        return JSONResponse(body)

    async def metrics_text(self, request: Request) -> Response:
        """The API process's metrics, then the core's (none while a new core starts)."""
        text = self.metrics.render()
        with contextlib.suppress(ApiError):
            text += await self.core.call("metrics")
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")



async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = exc.detail if isinstance(exc, HTTPException) else "internal error"
    return error_response(ApiError(status, f"{request.method} {request.url.path}: {message}"))


def build_app(ctx: ServerContext, api_key: str | None = None) -> Any:
    """The ASGI application over ``ctx`` (bearer auth in front when ``api_key`` is set; the web
    page at ``/`` is served without it). Its lifespan starts receiving from the engine core."""
    api = Api(ctx)
    responses = ResponsesRoutes(api)
    sessions = SessionRoutes(api)
    conversations = ConversationRoutes(api)
    r = api.route
    routes = [
        Route("/healthz", r("healthz", api.healthz), methods=["GET"]),
        Route("/metrics", r("metrics", api.metrics_text), methods=["GET"]),
        Route("/v1/models", r("models", api.models), methods=["GET"]),
        Route("/v1/chat/completions", r("chat", api.chat_completions), methods=["POST"]),
        Route("/v1/completions", r("completions", api.completions), methods=["POST"]),
        Route("/v1/responses", r("responses", responses.create), methods=["POST"]),
        Route("/v1/responses/{rid}", r("response", responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{rid}", r("response_delete", responses.delete), methods=["DELETE"]),
        Route("/v1/responses/{rid}/input_items", r("response_input_items", responses.input_items),
              methods=["GET"]),
        Route("/v1/conversations", r("conversation_create", conversations.create), methods=["POST"]),
        Route("/v1/conversations/{cid}", r("conversation", conversations.retrieve), methods=["GET"]),
        Route("/v1/conversations/{cid}", r("conversation_update", conversations.update), methods=["POST"]),
        Route("/v1/conversations/{cid}", r("conversation_delete", conversations.delete), methods=["DELETE"]),
        Route("/v1/conversations/{cid}/items", r("conversation_items", conversations.list_items), methods=["GET"]),
        Route("/v1/conversations/{cid}/items", r("conversation_items_add", conversations.add_items),
              methods=["POST"]),
        Route("/v1/conversations/{cid}/items/{item_id}", r("conversation_item", conversations.retrieve_item),
              methods=["GET"]),
        Route("/v1/conversations/{cid}/items/{item_id}", r("conversation_item_delete", conversations.delete_item),
              methods=["DELETE"]),
        Route("/v1/sessions", r("sessions", sessions.list_sessions), methods=["GET"]),
        Route("/v1/sessions/{sid}", r("session", sessions.get_session), methods=["GET"]),
        Route("/v1/sessions/{sid}", r("session_delete", sessions.delete_session), methods=["DELETE"]),
        Route("/v1/sessions/{sid}", r("session_patch", lambda req: patch_session(api, req)), methods=["PATCH"]),
        Route("/v1/sessions/{sid}/fork", r("session_fork", sessions.fork_session), methods=["POST"]),
        Route("/v1/sessions/{sid}/bundle", r("bundle_get", sessions.get_bundle), methods=["GET"]),
        Route("/v1/sessions/{sid}/bundle", r("bundle_put", sessions.put_bundle), methods=["PUT"]),
        Route("/v1/sessions/{sid}/pull", r("bundle_pull", sessions.pull_bundle), methods=["POST"]),
        Route("/v1/sessions/{sid}/suspend", r("session_suspend", sessions.suspend_session), methods=["POST"]),
    ]
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ctx.core.attach()
        yield
        ctx.core.detach()
        if ctx.fleet_proxy is not None:
            await ctx.fleet_proxy.close()

    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error}, lifespan=lifespan)
    return WithPage(BearerAuth(app, api_key))


__all__ = ["Api", "ServerContext", "build_app", "error_response"]
