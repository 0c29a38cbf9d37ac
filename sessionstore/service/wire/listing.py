"""``GET /v1/sessions`` paging (FORMAT.md 7): the query's ``limit`` / ``after`` / ``order`` checked
into a :class:`PageQuery` (one 400 in OpenAI's error shape naming the parameter), and OpenAI's
list object (``object: "list"``, ``data``, ``first_id``, ``last_id``, ``has_more``) around a page.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kernels.errors import ColiError
from sessionstore.service.errors import ApiError
from sessionstore.sessions import MAX_PAGE, ORDERS, CatalogueEntry, validate_session_id

DEFAULT_LIMIT = 100  # sessions per page when the query names no limit
MAX_LIMIT_DIGITS = 9  # a longer "limit" is refused before it is converted


@dataclass(frozen=True)
class PageQuery:
    """A checked page request: at most ``limit`` sessions after ``after`` in ``order``."""

    limit: int
    after: str | None
    order: str


def page_query(params: Mapping[str, str]) -> PageQuery:
    """The page ``params`` ask for; ApiError 400 (param named) for a bad limit, cursor or order."""
    raw = params.get("limit")
    if raw is None:
        limit = DEFAULT_LIMIT
    elif not raw.isascii() or not raw.isdigit() or len(raw) > MAX_LIMIT_DIGITS or not 1 <= int(raw) <= MAX_PAGE:
        raise ApiError(400, f"limit must be an integer from 1 to {MAX_PAGE}, found {raw[:40]!r}",
                       param="limit", code="invalid_value")
    else:
        limit = int(raw)
    order = params.get("order", "asc")
    if order not in ORDERS:
        raise ApiError(400, f"order must be one of {', '.join(ORDERS)}, found {order[:40]!r}",
                       param="order", code="invalid_value")
    after = params.get("after")
    if after is not None:
        try:
            validate_session_id(after)
        except ColiError as exc:
            raise ApiError(400, f"after: {exc}", param="after", code="invalid_value") from None
    return PageQuery(limit, after, order)


def problem_description(entry: CatalogueEntry) -> dict[str, Any]:
    """A listed session that cannot be served (its files gone, or its manifest unreadable): the
    session fields null, ``state`` says which, ``error`` why."""
    code = "session_files_missing" if entry.state == "missing" else "session_unreadable"
    return {"id": entry.id, "object": "session", "tokens": None, "committed": None, "bytes": None,
            "stored_bytes": None, "kv_dtype": None, "model": None, "state": entry.state, "last_use": None,
            "error": {"message": entry.error, "code": code}}


def in_window(session_id: str, query: PageQuery, last_id: str | None, has_more: bool) -> bool:
    """Whether ``session_id`` falls in the id range a page covers: past the cursor, and up to the
    page's last id when more follow (consecutive pages cover the id space exactly once)."""
    past = query.after is None or (session_id > query.after if query.order == "asc" else session_id < query.after)
    if not has_more or last_id is None:
        return past
    return past and (session_id <= last_id if query.order == "asc" else session_id >= last_id)


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list shape around one page of sessions."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


__all__ = ["DEFAULT_LIMIT", "PageQuery", "in_window", "list_object", "page_query", "problem_description"]
