"""OpenAI's Conversations API (FORMAT.md 7.5): ``POST /v1/conversations``, ``GET``, ``POST`` (its
metadata) and ``DELETE /v1/conversations/{id}``, ``GET`` and ``POST /v1/conversations/{id}/items``,
``GET`` and ``DELETE /v1/conversations/{id}/items/{item_id}``.

A conversation is a session (its id the session's): the handlers check the body and ask the engine
core, which keeps the conversation's items in the session's directory
(:mod:`sessionstore.service.engine.conversations`); a Responses turn with ``conversation`` runs on
that session (:mod:`.responses`). Nothing here touches the session's files.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sessionstore.service.errors import ApiError
from sessionstore.service.http.core_client import CoreClient
from sessionstore.service.http.items import item_page
from sessionstore.service.http.model_body import parse_body
from sessionstore.service.http.protocol import now
from sessionstore.service.http.responses import InputMessage, check_metadata, input_items
from sessionstore.service.limits import ServiceLimits
from sessionstore.service.wire import conversation_not_found, is_session_id, new_conversation_id

MAX_ITEMS_PER_REQUEST = 20  # OpenAI's bound on the items one create adds


class ConversationHost(Protocol):
    """What the routes use of the API they are part of (:class:`sessionstore.service.http.app.Api`)."""

    @property
    def core(self) -> CoreClient: ...
    @property
    def limits(self) -> ServiceLimits: ...

    async def body(self, request: Request) -> bytes: ...


class ConversationCreate(BaseModel):
    """``POST /v1/conversations``: optional first items and metadata."""

    model_config = ConfigDict(extra="ignore")
    items: list[InputMessage] | None = None
    metadata: dict[str, str] | None = None


class ConversationUpdate(BaseModel):
    """``POST /v1/conversations/{id}``: the metadata that replaces the conversation's."""

    model_config = ConfigDict(extra="ignore")
    metadata: dict[str, str]


class ItemsCreate(BaseModel):
    """``POST /v1/conversations/{id}/items``."""

    model_config = ConfigDict(extra="ignore")
    items: list[InputMessage]


def checked_items(given: list[InputMessage] | None) -> list[dict[str, Any]]:
    """The request's messages as OpenAI's items (fresh ids); more than 20 is a 400."""
    if given is not None and len(given) > MAX_ITEMS_PER_REQUEST:
        raise ApiError(400, f"{len(given)} items exceed the limit of {MAX_ITEMS_PER_REQUEST} per request",
                       param="items", code="limit_exceeded")
    return input_items(given or [], "items")[0]


def path_id(request: Request, name: str = "cid") -> str:
    """The conversation id in the path; one that cannot name a session is unknown (404)."""
    cid: str = request.path_params[name]
    if not is_session_id(cid):
        raise conversation_not_found(cid)
    return cid


class ConversationRoutes:
    """The Conversations API's handlers over one :class:`ConversationHost`."""

    def __init__(self, host: ConversationHost) -> None:
        self.host = host

    async def read(self, cid: str) -> dict[str, Any]:
        """The conversation and its items, from the core."""
        found: dict[str, Any] = await self.host.core.call("conversation_read", sid=cid)
        return found

    async def create(self, request: Request) -> Response:
        req: ConversationCreate = parse_body(await self.host.body(request), ConversationCreate)
        check_metadata(req.metadata)
        items = checked_items(req.items)
        body = await self.host.core.call("conversation_create", sid=new_conversation_id(), created_at=now(),
                                         metadata=req.metadata or {}, items=items)
        return JSONResponse(body)

    async def retrieve(self, request: Request) -> Response:
        found = await self.read(path_id(request))
        found.pop("items", None)
        return JSONResponse(found)

    async def update(self, request: Request) -> Response:
        cid = path_id(request)
        req: ConversationUpdate = parse_body(await self.host.body(request), ConversationUpdate)
        check_metadata(req.metadata)
        return JSONResponse(await self.host.core.call("conversation_update", sid=cid, metadata=req.metadata))

    async def delete(self, request: Request) -> Response:
        return JSONResponse(await self.host.core.call("conversation_delete", sid=path_id(request)))

    async def list_items(self, request: Request) -> Response:
        """A page of the items (``limit``, ``after``, ``order``; ``include`` is accepted: a message
        item has no further output to include)."""
        found = await self.read(path_id(request))
        return JSONResponse(item_page(found["items"], request.query_params, "in this conversation"))

    async def add_items(self, request: Request) -> Response:
        cid = path_id(request)
        req: ItemsCreate = parse_body(await self.host.body(request), ItemsCreate)
        added = await self.host.core.call("conversation_add_items", sid=cid, items=checked_items(req.items),
                                          max_items=self.host.limits.max_messages)
        return JSONResponse({"object": "list", "data": added, "first_id": added[0]["id"] if added else None,
                             "last_id": added[-1]["id"] if added else None, "has_more": False})

    async def retrieve_item(self, request: Request) -> Response:
        cid, item_id = path_id(request), request.path_params["item_id"]
        found = await self.read(cid)
        item = next((i for i in found["items"] if i.get("id") == item_id), None)
        if item is None:
            raise ApiError(404, f"conversation {cid!r} has no item {item_id[:80]!r}", param="item_id",
                           code="item_not_found")
        return JSONResponse(item)

    async def delete_item(self, request: Request) -> Response:
        """The item goes; the conversation is returned (as OpenAI does). The session is truncated
        where the item's tokens begin when its KV holds them."""
        cid = path_id(request)
        return JSONResponse(await self.host.core.call("conversation_delete_item", sid=cid,
                                                      item_id=request.path_params["item_id"]))

    def handlers(self) -> dict[str, Callable[[Request], Awaitable[Response]]]:
        return {"create": self.create, "retrieve": self.retrieve, "update": self.update, "delete": self.delete,
                "list_items": self.list_items, "add_items": self.add_items, "retrieve_item": self.retrieve_item,
                "delete_item": self.delete_item}


__all__ = ["ConversationCreate", "ConversationHost", "ConversationRoutes", "ConversationUpdate", "ItemsCreate",
           "MAX_ITEMS_PER_REQUEST", "checked_items", "path_id"]
