"""OpenAI's Conversations API in the engine core (FORMAT.md 7.5): a conversation IS a session.

Its id is the session's id (``conv_`` and 48 hex digits when the API makes one); its items, its
metadata and its creation time are one object (:class:`ConversationState`, schema
``coli-conversation``) in the session's ``responses.json`` (FORMAT.md 5.11) beside the session's
stored responses, so a bundle, the fleet's object store and every restart carry it with the
session's KV. A session is a conversation when that object is there.

The items are the session's messages: a Responses turn on a conversation renders the items as its
prompt's history (:func:`conversation_messages`) and runs on the session, so the prefix the KV holds
is reused token-exact and only the new input is prefilled; its input and output items are appended
in the same durable write as its response record (:func:`save_turn`). Deleting an item the KV has
consumed truncates the session where that item's tokens begin (:func:`op_delete_item`): the next
turn re-prefills from the cut.

Operations that change a conversation run as the engine's work holding its session (a turn on it
meanwhile is refused with 409); reads take the committed file, replaced whole, from a reader thread.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernels.errors import CorruptionError, FormatError
from sessionstore.service.engine.engine import Engine
from sessionstore.service.errors import ApiError
from sessionstore.service.wire import CONVERSATION_SCHEMA, ResponseRecord, conversation_not_found, is_session_id
from sessionstore.sessions import (
    ConversationRecord,
    common_prefix,
    read_response_list,
    remove_record,
    tokens_digest,
    write_record,
    write_response_list,
)

SCHEMA_VERSION = 1
TEXT_PART_SEPARATOR = "\n"  # between the text parts of one item (as the chat API joins a message's)


@dataclass
class ConversationState:
    """A conversation's object in its session's ``responses.json``."""

    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's item objects, oldest first

    def to_json(self) -> dict[str, Any]:
        return {"schema": CONVERSATION_SCHEMA, "version": SCHEMA_VERSION, "created_at": self.created_at,
                "metadata": self.metadata, "items": self.items}

    @classmethod
    def parse(cls, obj: dict[str, Any], where: str) -> ConversationState:
        if obj.get("version") != SCHEMA_VERSION:
            raise FormatError(f"{where}: conversation version {obj.get('version')!r} is not supported")
        created, metadata, items = obj.get("created_at"), obj.get("metadata"), obj.get("items")
        if isinstance(created, bool) or not isinstance(created, int):
            raise FormatError(f"{where}: created_at must be an integer")
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise FormatError(f"{where}: metadata must be an object of strings")
        if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("id"), str)
                                                  for i in items):
            raise FormatError(f"{where}: items must be a list of objects with an id")
        return cls(created, metadata, items)

    def index_of(self, item_id: str) -> int | None:
        return next((i for i, item in enumerate(self.items) if item.get("id") == item_id), None)


def item_text(item: dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return TEXT_PART_SEPARATOR.join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def conversation_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages the items stand for (``developer`` as ``system``, text parts joined)."""
    return [{"role": "system" if item.get("role") == "developer" else item.get("role"), "content": item_text(item)}
            for item in items if item.get("type") == "message"]


def output_item(record: ResponseRecord) -> dict[str, Any]:
    """A finished response's reply as the conversation keeps it (the response's output item)."""
    return {"id": "msg_" + record.id.removeprefix("resp_"), "type": "message", "role": "assistant",
            "status": "completed" if record.status == "completed" else "incomplete",
            "content": [{"type": "output_text", "text": record.output_text, "annotations": [], "logprobs": []}]}


# ---- the file --------------------------------------------------------------------------------
def _split(directory: Path) -> tuple[ConversationState | None, list[dict[str, Any]]]:
    """(the conversation object, the other items of ``responses.json``)."""
    state, others = None, []
    for obj in read_response_list(directory):
        if obj.get("schema") == CONVERSATION_SCHEMA:
            state = ConversationState.parse(obj, f"{directory.name}/responses.json")
        else:
            others.append(obj)
    return state, others


def read_state(engine: Engine, sid: str) -> ConversationState:
    """Conversation ``sid``'s object; a 404 when there is no such session or it is no conversation."""
    if not is_session_id(sid) or not engine.store.exists(sid):
        raise conversation_not_found(sid)
    directory = engine.store.session_dir(sid)
    try:
        state, _ = _split(directory)
    except FileNotFoundError:
        raise conversation_not_found(sid) from None
    except FormatError as exc:  # our own file, damaged: not the client's error
        raise CorruptionError(f"conversation {sid}: {exc}") from None
    if state is None:
        raise conversation_not_found(sid)
    return state


def write_state(engine: Engine, sid: str, state: ConversationState, record: ResponseRecord | None = None) -> None:
    """Replace the conversation's object (and put ``record`` in the list), in one durable write."""
    directory = engine.store.session_dir(sid)
    _, others = _split(directory)
    if record is not None:
        others = [*(o for o in others if o.get("id") != record.id), record.to_json()]
    write_response_list(directory, [state.to_json(), *others])


def save_turn(engine: Engine, sid: str, record: ResponseRecord, store: bool) -> None:
    """A finished Responses turn on conversation ``sid``: its input and output items appended (and
    its record kept with the session when ``store``)."""
    state = read_state(engine, sid)
    state.items = [*state.items, *record.input, output_item(record)]
    write_state(engine, sid, state, record if store else None)


# ---- operations -------------------------------------------------------------------------------
def _sid(args: dict[str, Any]) -> str:
    sid = args.get("sid")
    if not isinstance(sid, str) or not is_session_id(sid):
        raise conversation_not_found(str(sid))
    return sid


def _items(args: dict[str, Any]) -> list[dict[str, Any]]:
    items = args.get("items") or []
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ApiError(400, "items must be a list of item objects", param="items", code="invalid_value")
    return items


def describe(sid: str, state: ConversationState) -> dict[str, Any]:
    """OpenAI's conversation object."""
    return {"id": sid, "object": "conversation", "created_at": state.created_at, "metadata": state.metadata}


def op_create(engine: Engine, args: dict[str, Any]) -> dict[str, Any]:
    """``{sid, created_at, metadata, items}``: a new session holding a new conversation."""
    sid = _sid(args)
    if engine.store.exists(sid):
        raise ApiError(409, f"session {sid!r} already exists", code="session_exists")
    state = ConversationState(int(args["created_at"]), dict(args.get("metadata") or {}), _items(args))
    engine.open_session(sid, create=True)
    try:
        write_state(engine, sid, state)
    except BaseException:
        engine.delete(sid)
        raise
    return describe(sid, state)


def op_read(engine: Engine, args: dict[str, Any]) -> dict[str, Any]:
    """``{sid}``: the conversation object and its ``items``."""
    sid = _sid(args)
    state = read_state(engine, sid)
    return {**describe(sid, state), "items": state.items}


def op_update(engine: Engine, args: dict[str, Any]) -> dict[str, Any]:
    """``{sid, metadata}``: the conversation's metadata replaced."""
    sid = _sid(args)
    state = read_state(engine, sid)
    state.metadata = dict(args.get("metadata") or {})
    write_state(engine, sid, state)
    return describe(sid, state)


def op_delete(engine: Engine, args: dict[str, Any]) -> dict[str, Any]:
    """``{sid}``: the conversation and its session deleted."""
    sid = _sid(args)
    read_state(engine, sid)
    engine.delete(sid)
    return {"id": sid, "object": "conversation.deleted", "deleted": True}


def op_add_items(engine: Engine, args: dict[str, Any]) -> list[dict[str, Any]]:
    """``{sid, items, max_items}``: items appended (the KV takes them at the next turn)."""
    sid = _sid(args)
    state = read_state(engine, sid)
    added = _items(args)
    limit = int(args.get("max_items", 1 << 16))
    if len(state.items) + len(added) > limit:
        raise ApiError(400, f"the conversation would hold {len(state.items) + len(added)} items; at most {limit}",
                       param="items", code="limit_exceeded")
    state.items = [*state.items, *added]
    write_state(engine, sid, state)
    return added


def op_delete_item(engine: Engine, args: dict[str, Any]) -> dict[str, Any]:
    """``{sid, item_id}``: the item removed; when the session's KV holds its tokens, the session is
    truncated where they begin (the longest prefix the history shares with the items before it) and
    its conversation file set to those items (removed when they do not render to that prefix)."""
    sid = _sid(args)
    state = read_state(engine, sid)
    item_id = args.get("item_id")
    index = state.index_of(item_id) if isinstance(item_id, str) else None
    if index is None:
        raise ApiError(404, f"conversation {sid!r} has no item {str(item_id)[:80]!r}", param="item_id",
                       code="item_not_found")
    before = conversation_messages(state.items[:index])
    session, _ = engine.open_session(sid, create=False)
    history = session.history()
    tok = engine.runner.tok
    rendered = tok.chat_ids(before, add_generation_prompt=False) if before and tok is not None else []
    cut = common_prefix(history, rendered)
    if cut < len(history):
        session.truncate(cut)
        session.commit()
        directory = session.directory
        if before and rendered == history[:cut]:
            session.run_io(lambda: write_record(directory, ConversationRecord(before, cut, tokens_digest(rendered))))
        else:
            session.run_io(lambda: remove_record(directory))
    state.items = [*state.items[:index], *state.items[index + 1:]]
    write_state(engine, sid, state)
    return describe(sid, state)


__all__ = ["ConversationState", "conversation_messages", "describe", "op_add_items", "op_create", "op_delete",
           "op_delete_item", "op_read", "op_update", "output_item", "read_state", "save_turn", "write_state"]
