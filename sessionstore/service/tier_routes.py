"""The HTTP side of a session's tier (FORMAT.md 7, 5.10): ``retention_seconds`` and ``pinned``
beside ``session`` in a turn's body, ``PATCH /v1/sessions/{id}``, and the tier fields of a
session's description (``state`` ``offloaded``, ``retention_seconds``, ``pinned``)."""
from __future__ import annotations

from typing import Any

import msgspec
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kernels.errors import ColiError
from sessionstore.service.errors import ApiError
from sessionstore.service.protocol import parse_body
from sessionstore.sessions import MAX_RETENTION_S, CatalogueEntry, TierChange, check_retention, read_tier


class SessionPatch(BaseModel):
    """``PATCH /v1/sessions/{id}``: the fields given change; ``retention_seconds: null`` clears it."""

    model_config = ConfigDict(extra="forbid")
    retention_seconds: StrictInt | None = None
    pinned: StrictBool | None = None


def tier_change_of(req: BaseModel, session: str | None) -> TierChange | None:
    """The tier change a body asks for (its ``retention_seconds`` / ``pinned``, when given);
    None when it gives neither. Given without a session, or out of range: a 400 naming the field."""
    given = req.model_fields_set & {"retention_seconds", "pinned"}
    if not given:
        return None
    if session is None:
        raise ApiError(400, f"{sorted(given)[0]} applies to a session: give session (or X-Session-Id) too",
                       param=sorted(given)[0], code="invalid_value")
    retention = getattr(req, "retention_seconds", None)
    try:
        check_retention(retention)
    except ColiError:
        raise ApiError(400, f"retention_seconds must be from 1 to {MAX_RETENTION_S} seconds (or null: kept until "
                       f"deleted), found {retention}", param="retention_seconds", code="invalid_value") from None
    return TierChange("retention_seconds" in given, retention, getattr(req, "pinned", None))


def entry_tier_fields(entry: CatalogueEntry) -> dict[str, Any]:
    """The tier fields of a listed session (from its catalogue row)."""
    out: dict[str, Any] = {"retention_seconds": entry.retention_s, "pinned": entry.pinned}
    if entry.state == "offloaded":
        out.update(state="offloaded", location=entry.location)
    return out


def session_tier_fields(engine: Any, sid: str) -> dict[str, Any]:
    """The tier fields of one session (from its tier record)."""
    try:
        record = read_tier(engine.store.session_dir(sid))
    except ColiError:
        return {}
    out: dict[str, Any] = {"retention_seconds": record.retention_seconds, "pinned": record.pinned}
    if record.offloaded is not None:
        out.update(state="offloaded", location=record.offloaded.location, bytes=record.offloaded.bytes)
    return out


async def patch_session(api: Any, request: Request) -> Response:
    """``PATCH /v1/sessions/{id}`` with ``retention_seconds`` and/or ``pinned``: the session's
    description after the change (404: no such session; 409 while a request holds it)."""
    sid = api.session_id(request)
    req: SessionPatch = parse_body(await api.body(request), SessionPatch)
    change = tier_change_of(req, sid)
    if change is None:
        raise ApiError(400, "give retention_seconds and/or pinned", code="invalid_value")
    return JSONResponse(await api.core.call("tier_change", sid=sid, change=msgspec.to_builtins(change)))


__all__ = ["SessionPatch", "entry_tier_fields", "patch_session", "session_tier_fields", "tier_change_of"]
