"""What the Responses and Conversations APIs share of OpenAI's item lists: one page of items
(``input_items``, a conversation's items) and the ``conversation`` a response names (FORMAT.md 7.3, 7.5)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sessionstore.service.errors import ApiError


def item_page(items: list[dict[str, Any]], q: Mapping[str, str], where: str) -> dict[str, Any]:
    """One page of ``items`` as OpenAI lists them (``order`` desc by default, ``limit`` 1-100 (20),
    ``after`` an item id; ``where`` names the list in the 404 for an unknown ``after``)."""
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be 'asc' or 'desc'", param="order")
    raw = q.get("limit", "20")
    if not (raw.isdigit() and len(raw) <= 3 and 1 <= int(raw) <= 100):
        raise ApiError(400, "limit must be an integer in [1, 100]", param="limit")
    items = items if order == "asc" else items[::-1]
    after = q.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise ApiError(404, f"no item {after[:80]!r} {where}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:int(raw)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


def conversation_of(value: str | dict[str, Any] | None) -> str | None:
    """The conversation id ``conversation`` names (a string, or ``{"id": ...}``); else a 400."""
    if value is None or isinstance(value, str):
        return value
    cid = value.get("id")
    if not isinstance(cid, str):
        raise ApiError(400, "conversation must be a conversation id or an object with a string 'id'",
                       param="conversation", code="invalid_value")
    return cid


__all__ = ["conversation_of", "item_page"]
