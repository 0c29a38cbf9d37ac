"""Stored responses where only the engine core keeps them: in a fleet's object store
(:class:`FleetResponses`, FORMAT.md 7.3) and in their session's ``responses.json`` (FORMAT.md 5.11),
so a bundle of the session carries them. The record itself and the store root's responses directory
are both processes' (:mod:`sessionstore.service.wire.response_records`)."""
from __future__ import annotations

import json
from pathlib import Path

from kernels.errors import CorruptionError, FormatError
from sessionstore.migration import ObjectPrefix, ObjectRecords
from sessionstore.service.wire import (
    CONVERSATION_SCHEMA,
    MAX_RECORD_BYTES,
    RESPONSES_DIR,
    ResponseRecord,
    is_response_id,
    parse_record,
)
from sessionstore.sessions import read_response_list, write_response_list


class FleetResponses:
    """The records in a fleet's object store (``<prefix>/responses/<id>.json``): written by the host
    that made them, read by any host asked to continue a chain it does not know (FORMAT.md 7.3)."""

    def __init__(self, objects: ObjectPrefix) -> None:
        self.shelf = ObjectRecords(objects, RESPONSES_DIR, MAX_RECORD_BYTES)

    def put(self, record: ResponseRecord) -> None:
        self.shelf.put(f"{record.id}.json", record.encode())

    def get(self, response_id: str) -> ResponseRecord | None:
        """The fleet's record ``response_id`` (None: none, or not one of our ids)."""
        if not is_response_id(response_id):
            return None
        data = self.shelf.get(f"{response_id}.json")
        if data is None:
            return None
        try:
            return parse_record(json.loads(data), f"fleet response {response_id}")
        except (ValueError, FormatError) as exc:
            raise CorruptionError(f"the fleet's stored response {response_id}: {exc}") from None

    def delete(self, response_id: str) -> None:
        if is_response_id(response_id):
            self.shelf.delete(f"{response_id}.json")


def keep_with_session(directory: Path, record: ResponseRecord) -> None:
    """Put ``record`` in its session's ``responses.json`` (replacing one of the same id), so that a
    bundle of the session carries it (FORMAT.md 5.11)."""
    items = [item for item in read_response_list(directory) if item.get("id") != record.id]
    write_response_list(directory, [*items, record.to_json()])


def drop_from_session(directory: Path, response_id: str) -> int:
    """Take ``response_id`` out of its session's ``responses.json`` (a deleted response); the
    number of stored responses the session still holds."""
    items = read_response_list(directory)
    kept = [item for item in items if item.get("id") != response_id]
    if len(kept) != len(items):
        write_response_list(directory, kept)
    return sum(1 for item in kept if item.get("schema") != CONVERSATION_SCHEMA)


def session_records(directory: Path, session_id: str) -> list[ResponseRecord]:
    """The records a received session's ``responses.json`` holds, each checked, pointed at
    ``session_id`` (the id the session was installed as); a bad one is a FormatError."""
    records = [parse_record(item, f"{directory.name}/responses.json") for item in read_response_list(directory)
               if item.get("schema") != CONVERSATION_SCHEMA]  # a conversation's object: not a record
    for record in records:
        record.session = session_id
    return records


__all__ = ["FleetResponses", "drop_from_session", "keep_with_session", "session_records"]
