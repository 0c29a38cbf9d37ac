"""``--fleet-proxy``: a request for a session another live host of the fleet holds is forwarded to
that host (its lease's ``--advertise-url``) and its answer streamed back, for clients that do not
follow a 307 (most do not repeat a POST's body). The forwarded request carries the header
``X-Coli-Proxied-By`` (this host's id); a request that carries it is never forwarded again (a
holder that moved meanwhile answers 307/409 itself), so two hosts never bounce a request."""
from __future__ import annotations

from typing import Any

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

PROXIED_HEADER = "x-coli-proxied-by"
# hop-by-hop headers (RFC 9110 7.6.1) and the ones the two connections set themselves
_NOT_FORWARDED = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                            "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # a turn may think for minutes between its first byte and its last


class FleetProxy:
    """Forwards requests to their session's holder over one pooled HTTP client."""

    def __init__(self, host_id: str) -> None:
        self.host_id = host_id
        self._client: httpx.AsyncClient | None = None

    def forwardable(self, request: Request) -> bool:
        """Not forwarded before (no loops), and its body (if any) was read whole by the handler."""
        return PROXIED_HEADER not in request.headers and (
            request.method in ("GET", "DELETE", "HEAD") or getattr(request.state, "body", None) is not None)

    async def forward(self, request: Request, holder_url: str) -> Response:
        """``request`` sent to ``holder_url`` (same method, path, query, headers, body); its answer
        streamed back as it comes (an SSE stream included)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        headers[PROXIED_HEADER] = self.host_id
        url = holder_url.rstrip("/") + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        sent = self._client.build_request(request.method, url, headers=headers,
                                          content=getattr(request.state, "body", None))
        answer = await self._client.send(sent, stream=True)
        back: dict[str, Any] = {k: v for k, v in answer.headers.items() if k.lower() not in _NOT_FORWARDED}
        back["x-coli-served-by"] = holder_url
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code, headers=back,
                                 background=BackgroundTask(answer.aclose))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


__all__ = ["FleetProxy", "PROXIED_HEADER"]
