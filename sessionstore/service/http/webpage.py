"""The service's web page: ``GET /`` and its assets, shipped in ``sessionstore/service/http/web/``.

They are served without auth (they hold no data; every API call the page makes carries the key),
with ``Cache-Control: no-cache`` and a Content-Security-Policy that allows only this origin.
"""
from __future__ import annotations

from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

CSP = "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
ASSETS = {  # path -> (file in web/, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/web/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/web/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/web/settings.js": ("settings.js", "text/javascript; charset=utf-8"),
    "/web/style.css": ("style.css", "text/css; charset=utf-8"),
    "/web/icon.svg": ("icon.svg", "image/svg+xml"),
}
PAGE_METHODS = frozenset({"GET", "HEAD"})


def read_asset(name: str) -> bytes:
    """The bytes of ``web/<name>`` inside the installed package."""
    return resources.files("sessionstore.service.http").joinpath("web", name).read_bytes()


def asset_route(path: str, name: str, media_type: str) -> Route:
    body = read_asset(name)  # read once: the files are part of the installed package
    headers = {"cache-control": "no-cache", "content-security-policy": CSP, "x-content-type-options": "nosniff",
               "referrer-policy": "no-referrer"}

    async def serve(request: Request) -> Response:
        return Response(body, media_type=media_type, headers=headers)

    return Route(path, serve, methods=list(PAGE_METHODS))


class WithPage:
    """ASGI: GET/HEAD of the page's paths go to the page, everything else to ``api``."""

    def __init__(self, api: Any) -> None:
        self.api = api
        self.page = Router(routes=[asset_route(path, name, media) for path, (name, media) in ASSETS.items()])

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in ASSETS and scope["method"] in PAGE_METHODS:
            await self.page(scope, receive, send)
        else:
            await self.api(scope, receive, send)


__all__ = ["ASSETS", "CSP", "WithPage", "read_asset"]
