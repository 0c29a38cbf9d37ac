"""The engine core's named operations (what a :class:`~sessionstore.service.wire.ipc.Call` may ask),
and the sessions' descriptions the API returns, built where the sessions live.

An operation is ``fn(engine, args) -> value`` (a msgpack-able value). ``exclusive`` ones change a
session: they run as the engine's work holding that session (a busy session is refused with 409);
the others only read committed files or the engine's bookkeeping and run on a reader thread, never
waiting behind a turn.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from kernels.rows import KV_FORMAT_OF_DTYPE
from sessionstore.kvfile import HEADER_SIZE, Dims, record_bytes
from sessionstore.migration import BundleStats, ReceivedBundle
from sessionstore.service.engine import conversations
from sessionstore.service.engine.engine import Engine
from sessionstore.service.engine.messages import session_messages
from sessionstore.service.engine.session_responses import FleetResponses, drop_from_session, session_records
from sessionstore.service.engine.tier_fields import entry_tier_fields, session_tier_fields
from sessionstore.service.errors import ApiError
from sessionstore.service.wire import (
    CONVERSATION_SCHEMA,
    PageQuery,
    ResponseRecord,
    ResponseRecords,
    in_window,
    is_chain_session,
    list_object,
    problem_description,
)
from sessionstore.sessions import (
    CatalogueEntry,
    TierChange,
    read_response_list,
    validate_session_id,
    write_response_list,
)


def stored_bytes(engine: Engine, committed: int, kv_dtype: str, fingerprint: str) -> int | None:
    """The bytes a session's committed records take in its ``.coli_kv`` file, header included: what
    its user stored, without the headroom its writer keeps for the next tokens (``bytes`` counts
    every file as it lies on disk). None for a session of another model than this server's."""
    fmt = KV_FORMAT_OF_DTYPE.get(kv_dtype)
    if fmt is None or fingerprint != engine.model_ref.fingerprint:
        return None
    n_layers, kv_lora, rope, index_dim, n_index, vocab = engine.model.dims_for_file()
    dims = Dims(n_layers, kv_lora, rope, index_dim, n_index, vocab)
    return HEADER_SIZE + committed * record_bytes(fmt[0], dims, fmt[1])


def describe(engine: Engine, sid: str) -> dict[str, Any]:
    """One session as ``GET /v1/sessions/{id}`` shows it (FORMAT.md 7)."""
    info = engine.store.info(sid)
    last = engine.last_use.get(sid)
    return {"id": sid, "object": "session", "tokens": info.tokens + len(info.pending), "committed": info.tokens,
            "bytes": info.bytes, "stored_bytes": stored_bytes(engine, info.tokens, info.kv_dtype, info.fingerprint),
            "kv_dtype": info.kv_dtype, "model": info.model, "state": engine.state_of(sid),
            "last_use": info.updated_at if last is None else datetime.fromtimestamp(last, UTC).isoformat(),
            **session_tier_fields(engine, sid)}


def describe_listed(engine: Engine, entry: CatalogueEntry) -> dict[str, Any]:
    """A page's entry as :func:`describe` gives it; one whose files are gone (or unreadable) as such."""
    if entry.state in ("missing", "unreadable"):
        return problem_description(entry)
    last = engine.last_use.get(entry.id)
    return {"id": entry.id, "object": "session", "tokens": entry.tokens, "committed": entry.committed,
            "bytes": entry.bytes,
            "stored_bytes": stored_bytes(engine, entry.committed, entry.kv_dtype, entry.fingerprint),
            "kv_dtype": entry.kv_dtype, "model": entry.model,
            "state": engine.state_of(entry.id),
            "last_use": entry.last_use if last is None else datetime.fromtimestamp(last, UTC).isoformat(),
            **entry_tier_fields(entry)}


def check_target(engine: Engine, session_id: str, replace: bool) -> None:
    """Refuse a bundle over a taken id without ``replace`` (409 session_exists) or over a resident
    session (409 session_live): before the body is read, and again at the install."""
    if not replace and engine.store.exists(session_id):
        raise ApiError(409, f"session {session_id!r} already exists here (replace=0)", code="session_exists")
    if engine.state_of(session_id) == "resident":
        raise ApiError(409, f"session {session_id!r} is resident here; suspend it before replacing it",
                       code="session_live")


def _session(args: dict[str, Any], key: str = "sid") -> str:
    sid = args.get(key)
    if not isinstance(sid, str):
        raise ApiError(400, f"{key}: a session id is required", code="invalid_value")
    validate_session_id(sid)
    return sid


def _existing(engine: Engine, args: dict[str, Any]) -> str:
    sid = _session(args)
    if not engine.store.exists(sid):
        raise ApiError(404, f"no session {sid!r}", code="session_not_found")
    return sid


# ---- reads --------------------------------------------------------------------------------------
def op_describe(engine: Engine, args: dict[str, Any]) -> dict[str, Any]:
    """``{sid, history?, messages?}``: the session's description, its token ids and its messages
    when asked (from the committed files: never waits for a turn)."""
    sid = _existing(engine, args)
    body = describe(engine, sid)
    if args.get("history"):
        body["history"] = engine.store.history(sid)
    if args.get("messages"):
        body.update(session_messages(engine, sid))
    return body


def op_list(engine: Engine, args: dict[str, Any]) -> dict[str, Any]:
    """``{limit, after, order}``: one page of the catalogue in OpenAI's list shape (a fleet server
    adds the fleet's sessions, state ``remote`` where not current here)."""
    query = PageQuery(int(args["limit"]), args.get("after"), str(args.get("order", "asc")))
    page = engine.store.page(query.limit, query.after, query.order)
    data = [describe_listed(engine, entry) for entry in page.entries]
    if engine.home is not None:
        last_id = data[-1]["id"] if data else None
        fleet = engine.home.listing(data)
        data = [d for d in fleet if in_window(str(d["id"]), query, last_id, page.has_more)]
        data.sort(key=lambda d: str(d["id"]), reverse=query.order == "desc")
    return list_object(data, page.has_more)


def op_check_target(engine: Engine, args: dict[str, Any]) -> None:
    """``{sid, replace}``: refuse a bundle over a taken id (without replace) or a resident session."""
    check_target(engine, _session(args), bool(args.get("replace", True)))


def op_fenced(engine: Engine, args: dict[str, Any]) -> list[dict[str, Any]]:
    """The sessions fenced by a failed commit (FORMAT.md 5.5), as ``/healthz`` lists them."""
    listed: list[dict[str, Any]] = engine.fences.listed()
    return listed


def op_metrics(engine: Engine, args: dict[str, Any]) -> bytes:
    """The core's metrics in Prometheus' text format."""
    return engine.metrics.render()


# ---- changes (exclusive: the session claimed) -----------------------------------------------------
def op_delete(engine: Engine, args: dict[str, Any]) -> None:
    engine.delete(_session(args))


def op_suspend(engine: Engine, args: dict[str, Any]) -> dict[str, Any]:
    sid = _session(args)
    engine.suspend(sid)
    return describe(engine, sid)


def op_fork(engine: Engine, args: dict[str, Any]) -> dict[str, Any]:
    """``{sid, new, at}``: fork ``sid`` as ``new`` (at ``at`` tokens, or whole); the new one's description."""
    sid, new = _session(args), _session(args, "new")
    at = args.get("at")
    engine.fork(sid, new, None if at is None else int(at))
    return describe(engine, new)


def op_install(engine: Engine, args: dict[str, Any]) -> dict[str, Any]:
    """``{sid, tmp, source_name, stats, start, replace}``: install a bundle the API process received
    and verified into ``<root>/tmp/`` (an upload, a pull) as ``sid``; its import result. The temp
    directory must be the store's own."""
    sid = _session(args)
    tmp = Path(str(args["tmp"])).resolve()
    if tmp.parent != (Path(engine.store.root) / "tmp").resolve():
        raise ApiError(400, "install: not a directory of the store's tmp/", code="invalid_value")
    received = ReceivedBundle(engine.store, tmp, str(args.get("bundle_id", sid)), str(args["source_name"]),
                              msgspec.convert(args["stats"], BundleStats), float(args["start"]))
    replace = bool(args.get("replace", True))
    try:
        check_target(engine, sid, replace)
        records = session_records(tmp, sid)  # its stored responses, checked before anything is installed
        engine.forget(sid)
    except BaseException:
        received.discard()
        raise
    result = received.install(sid, replace=True).to_json()
    adopt_records(engine, sid, records)
    return result


def adopt_records(engine: Engine, sid: str, records: list[ResponseRecord]) -> None:
    """A received session's stored responses become this store's (by id; pointed at ``sid``)."""
    if not records:
        return
    store = ResponseRecords(Path(engine.store.root))
    for record in records:
        store.write(record)
    directory = engine.store.session_dir(sid)
    kept = [obj for obj in read_response_list(directory) if obj.get("schema") == CONVERSATION_SCHEMA]
    write_response_list(directory, [*kept, *(record.to_json() for record in records)])


def fleet_responses(engine: Engine) -> FleetResponses | None:
    """The fleet's response records (``serve --remote``), or None."""
    return None if engine.home is None else FleetResponses(engine.home.remote.objects)


def op_fetch_response(engine: Engine, args: dict[str, Any]) -> dict[str, Any] | None:
    """``{rid}``: a stored response this store does not hold, from the fleet's object store (kept
    here once found); None when the fleet has none either."""
    rid = args.get("rid")
    fleet = fleet_responses(engine)
    if not isinstance(rid, str) or fleet is None:
        return None
    local = ResponseRecords(Path(engine.store.root))
    record = local.read(rid) or fleet.get(rid)
    if record is None:
        return None
    local.write(record)
    return record.to_json()


def op_delete_response(engine: Engine, args: dict[str, Any]) -> bool:
    """``{rid, sid}``: delete a stored response (its file, and its copy in its session's list); True if
    it was there. Run holding its session (``sid``, the record's), whose turns write that list. A
    session the Responses API made for the chain goes with the last response that continued it (a
    client's own session, or a conversation, stays: they are deleted by name)."""
    rid = args.get("rid")
    if not isinstance(rid, str):
        raise ApiError(400, "rid: a response id is required", code="invalid_value")
    store = ResponseRecords(Path(engine.store.root))
    record = store.read(rid)
    if record is None:
        return False
    left = None
    if engine.store.exists(record.session):
        left = drop_from_session(engine.store.session_dir(record.session), rid)
    fleet = fleet_responses(engine)
    if fleet is not None:
        fleet.delete(rid)
    deleted = store.delete(rid)
    if left == 0 and is_chain_session(record.session):
        engine.delete(record.session)
    return deleted


def op_tier_change(engine: Engine, args: dict[str, Any]) -> dict[str, Any]:
    """``{sid, change}``: a session's ``retention_seconds`` / ``pinned`` (a
    :class:`~sessionstore.sessions.tier_record.TierChange`'s fields); its description after."""
    sid = _existing(engine, args)
    engine.tiers.change(sid, msgspec.convert(args["change"], TierChange))
    return describe(engine, sid)


@dataclass(frozen=True)
class Operation:
    fn: Callable[[Engine, dict[str, Any]], Any]
    exclusive: bool  # runs as the engine's work holding args["sid"]


OPERATIONS: dict[str, Operation] = {
    "describe": Operation(op_describe, False),
    "list": Operation(op_list, False),
    "check_target": Operation(op_check_target, False),
    "metrics": Operation(op_metrics, False),
    "fenced": Operation(op_fenced, False),
    "delete": Operation(op_delete, True),
    "suspend": Operation(op_suspend, True),
    "fork": Operation(op_fork, True),
    "install": Operation(op_install, True),
    "delete_response": Operation(op_delete_response, True),
    "fetch_response": Operation(op_fetch_response, False),
    "tier_change": Operation(op_tier_change, True),
    # the Conversations API (FORMAT.md 7.5): a conversation is a session
    "conversation_create": Operation(conversations.op_create, True),
    "conversation_read": Operation(conversations.op_read, False),
    "conversation_update": Operation(conversations.op_update, True),
    "conversation_delete": Operation(conversations.op_delete, True),
    "conversation_add_items": Operation(conversations.op_add_items, True),
    "conversation_delete_item": Operation(conversations.op_delete_item, True),
}


__all__ = ["OPERATIONS", "Operation", "check_target", "describe", "describe_listed", "fleet_responses",
           "stored_bytes"]
