"""The HTTP side of a session's tier (FORMAT.md 7, 5.10): ``retention_seconds`` and ``pinned``
beside ``session`` in a turn's body and ``PATCH /v1/sessions/{id}``. The tier fields of a session's
description are built in the engine core (:mod:`sessionstore.service.engine.tier_fields`)."""
from __future__ import annotations

import msgspec
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kernels.errors import ColiError
from sessionstore.service.errors import ApiError
from sessionstore.service.http.model_body import parse_body
from sessionstore.service.http.session_routes import SessionHost
from sessionstore.sessions import MAX_RETENTION_S, TierChange, check_retention


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
        raise ApiError(400, f"{sorted(given)[0]} applies to a session: give session (or session_id, or "
                       "X-Session-Id) too",
                       param=sorted(given)[0], code="invalid_value")
    retention = getattr(req, "retention_seconds", None)
    try:
        check_retention(retention)
    except ColiError:
        raise ApiError(400, f"retention_seconds must be from 1 to {MAX_RETENTION_S} seconds (or null: kept until "
                       f"deleted), found {retention}", param="retention_seconds", code="invalid_value") from None
    return TierChange("retention_seconds" in given, retention, getattr(req, "pinned", None))


async def patch_session(api: SessionHost, request: Request) -> Response:
    """``PATCH /v1/sessions/{id}`` with ``retention_seconds`` and/or ``pinned``: the session's
    description after the change (404: no such session; 409 while a request holds it)."""
    sid = api.session_id(request)
    req: SessionPatch = parse_body(await api.body(request), SessionPatch)
    change = tier_change_of(req, sid)
    if change is None:
        raise ApiError(400, "give retention_seconds and/or pinned", code="invalid_value")
    return JSONResponse(await api.core.call("tier_change", sid=sid, change=msgspec.to_builtins(change)))


__all__ = ["SessionPatch", "patch_session", "tier_change_of"]
