"""The sessions API's routes (FORMAT.md 7): list, describe, delete, fork and suspend a session (each
an operation of the engine core, asked over IPC), and move one as a bundle (``GET`` and ``PUT
.../bundle``, ``POST .../pull``: the bytes streamed by the fleet room, installed by the core).
``PATCH`` (retention, pinning) is :mod:`.tier_routes`'."""
from __future__ import annotations

from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from sessionstore.service.errors import ApiError
from sessionstore.service.fleet import bundle_pull, bundle_upload, export_compression, export_stream
from sessionstore.service.fleet.bundle_pull import PullPolicy
from sessionstore.service.http.core_client import CoreClient
from sessionstore.service.http.model_body import parse_body
from sessionstore.service.http.protocol import ForkRequest, PullRequest
from sessionstore.service.limits import ServiceLimits
from sessionstore.service.wire import page_query
from sessionstore.sessions import SessionStore, validate_session_id


class SessionHost(Protocol):
    """What the routes use of the API they are part of (:class:`sessionstore.service.http.app.Api`)."""

    @property
    def core(self) -> CoreClient: ...
    @property
    def store(self) -> SessionStore: ...
    @property
    def limits(self) -> ServiceLimits: ...
    @property
    def pull(self) -> PullPolicy | None: ...
    @property
    def model_source(self) -> str: ...

    async def body(self, request: Request) -> bytes: ...
    def session_id(self, request: Request) -> str: ...


class SessionRoutes:
    """The sessions API's handlers over one :class:`SessionHost`."""

    def __init__(self, host: SessionHost) -> None:
        self.host = host

    async def list_sessions(self, request: Request) -> Response:
        """One page from the store's catalogue (``?limit=N&after=ID&order=asc|desc``, FORMAT.md 7)."""
        query = page_query(request.query_params)
        return JSONResponse(await self.host.core.call("list", limit=query.limit, after=query.after, order=query.order))

    async def describe(self, sid: str) -> dict[str, Any]:
        described: dict[str, Any] = await self.host.core.call("describe", sid=sid)
        return described

    async def get_session(self, request: Request) -> Response:
        sid = self.host.session_id(request)
        flags = {k: request.query_params.get(k) in ("1", "true") for k in ("history", "messages")}
        return JSONResponse(await self.host.core.call("describe", sid=sid, **flags))

    async def delete_session(self, request: Request) -> Response:
        sid = self.host.session_id(request)
        await self.host.core.call("delete", sid=sid)
        return JSONResponse({"id": sid, "object": "session.deleted", "deleted": True})

    async def fork_session(self, request: Request) -> Response:
        sid = self.host.session_id(request)
        req: ForkRequest = parse_body(await self.host.body(request), ForkRequest)
        validate_session_id(req.new)
        return JSONResponse(await self.host.core.call("fork", sid=sid, new=req.new, at=req.at))

    async def get_bundle(self, request: Request) -> Response:
        sid = self.host.session_id(request)
        if not self.host.store.exists(sid):
            raise ApiError(404, f"no session {sid!r}", code="session_not_found")
        compression = export_compression(request.query_params.get("compress"),
                                         request.client.host if request.client else None)
        body, headers = await export_stream(self.host.store, sid, compression)
        return StreamingResponse(body, media_type="application/octet-stream", headers=headers)

    async def pull_bundle(self, request: Request) -> Response:
        sid = self.host.session_id(request)
        req: PullRequest = parse_body(await self.host.body(request), PullRequest)
        result = await bundle_pull.pull_bundle(self.bundle_host, sid, req.source, self.host.pull,
                                               limit=self.host.limits.max_bundle_bytes, replace=req.replace)
        return JSONResponse({**await self.describe(sid), "imported": result})

    async def put_bundle(self, request: Request) -> Response:
        sid = self.host.session_id(request)
        replace = request.query_params.get("replace", "1") not in ("0", "false")  # ?replace=0: refuse a taken id
        result = await bundle_upload.put_bundle(self.bundle_host, sid, request.stream(),
                                                limit=self.host.limits.max_bundle_bytes,
                                                declared=request.headers.get("content-length"), replace=replace)
        return JSONResponse({**await self.describe(sid), "imported": result})

    @property
    def bundle_host(self) -> bundle_upload.BundleHost:
        return bundle_upload.BundleHost(self.host.store, self.host.model_source, self.host.core)

    async def suspend_session(self, request: Request) -> Response:
        sid = self.host.session_id(request)
        return JSONResponse(await self.host.core.call("suspend", sid=sid))


__all__ = ["SessionHost", "SessionRoutes"]
