"""Bearer-key authentication as ASGI middleware: every path but ``/healthz`` needs
``Authorization: Bearer KEY`` when the server has a key (the scheme in any case, RFC 9110 11.1)."""
from __future__ import annotations

import hmac
import json
from typing import Any

from sessionstore.service.errors import ApiError

OPEN_PATHS = frozenset({"/healthz"})


def bearer_token(header: bytes) -> bytes | None:
    """The credentials of an ``Authorization`` value whose scheme is ``Bearer`` (any case), else None."""
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip(b" \t")


class BearerAuth:
    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.expected = None if api_key is None else api_key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = bearer_token(dict(scope.get("headers") or []).get(b"authorization", b""))
        if given is not None and hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        error = ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY", code="invalid_api_key")
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


__all__ = ["BearerAuth", "OPEN_PATHS", "bearer_token"]
