"""Stored responses of ``POST /v1/responses`` (FORMAT.md 7.6): one JSON file per response in
``<store root>/responses/``, each a checkpoint of a session at a token count.

A record names the session its chain lives in, the length of that session's token history at
the response's end and the SHA-256 of those tokens (:func:`tokens_digest`, as the conversation
file's), so a later request can tell whether the session still holds the checkpoint (the
newest response of a chain: continue in place), holds it as a prefix (an older response:
fork there) or no longer holds it (start a new session from the record's messages). The
record carries the whole conversation it ends (``messages``, without ``instructions``, which
OpenAI does not carry over a chain), so no record depends on another: deleting one never
breaks the responses that continued it.

Files are written whole and durably (temp, fsync, rename, fsync directory:
:func:`sessionstore.kvfile.atomic_replace`) before the response is returned; a response id
is checked against :data:`RESPONSE_ID` before it names a path.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernels.errors import CorruptionError, FormatError
from kernels.jsonfile import read_json_bounded
from sessionstore.kvfile import atomic_replace, readable_temp, unlink_durably
from sessionstore.service.wire.turn_spec import TurnOutcome
from sessionstore.sessions import confined

RESPONSES_DIR = "responses"
SCHEMA = "coli-response"
SCHEMA_VERSION = 1
CONVERSATION_SCHEMA = "coli-conversation"  # a conversation's object in its session's list (FORMAT.md 7.5)
MAX_RECORD_BYTES = 32 << 20
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{48}\Z")


def new_response_id() -> str:
    """A fresh response id: ``resp_`` and 48 hex digits."""
    return "resp_" + secrets.token_hex(24)


def is_response_id(value: str) -> bool:
    return RESPONSE_ID.match(value) is not None


@dataclass
class ResponseRecord:
    """One stored response: what it answered, what it said and where its chain's tokens live."""

    id: str
    model: str
    created_at: int
    session: str  # the session holding the chain's tokens
    tokens: int  # the session's history length at this response's end
    digest: str  # tokens_digest of those tokens
    messages: list[dict[str, Any]]  # the conversation this response ends (its reply last), no instructions
    input: list[dict[str, Any]]  # the input items this response added (OpenAI's input item shape)
    output_text: str
    output_tokens: list[int]
    status: str  # "completed" | "incomplete"
    incomplete_reason: str | None
    usage: dict[str, Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, seed, max_output_tokens
    conversation: str | None = None  # the conversation the response belongs to (FORMAT.md 7.5)

    def to_json(self) -> dict[str, Any]:
        """The record's JSON object, as stored."""
        return {"schema": SCHEMA, "version": SCHEMA_VERSION, **asdict(self)}

    def encode(self) -> bytes:
        return (json.dumps(self.to_json(), ensure_ascii=False) + "\n").encode("utf-8")


_FIELDS = {"id": str, "model": str, "created_at": int, "session": str, "tokens": int, "digest": str,
           "messages": list, "input": list, "output_text": str, "output_tokens": list, "status": str,
           "usage": dict, "metadata": dict, "params": dict}


def parse_record(obj: Any, where: str) -> ResponseRecord:
    """A record from its JSON object; a wrong schema, version or field type is a FormatError."""
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise FormatError(f"{where}: not a response record (schema {SCHEMA!r} expected)")
    if obj.get("version") != SCHEMA_VERSION:
        raise FormatError(f"{where}: response record version {obj.get('version')!r} is not supported")
    for name, kind in _FIELDS.items():
        value = obj.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise FormatError(f"{where}: {name} must be a JSON {kind.__name__}")
    for name in ("instructions", "previous_response_id", "incomplete_reason", "conversation"):
        if obj.get(name) is not None and not isinstance(obj.get(name), str):
            raise FormatError(f"{where}: {name} must be a string or null")
    fields: dict[str, Any] = {k: obj.get(k) for k in ResponseRecord.__dataclass_fields__}
    return ResponseRecord(**fields)


class ResponseRecords:
    """The responses directory of one store root."""

    def __init__(self, root: Path) -> None:
        self.directory = confined(root, RESPONSES_DIR)
        self.directory.mkdir(exist_ok=True)

    def _path(self, response_id: str) -> Path | None:
        return self.directory / f"{response_id}.json" if is_response_id(response_id) else None

    def write(self, record: ResponseRecord) -> None:
        """Store ``record`` whole and durably (replacing one of the same id)."""
        path = self._path(record.id)
        assert path is not None, "records are written under ids new_response_id made"
        data = record.encode()
        if len(data) > MAX_RECORD_BYTES:
            raise FormatError(f"the response is larger than {MAX_RECORD_BYTES} bytes stored")
        atomic_replace(path, data, make_temp=readable_temp(".response-"), durable=True)

    def read(self, response_id: str) -> ResponseRecord | None:
        """The record ``response_id``, or None when there is none (or the id is not one of ours);
        a damaged file is a CorruptionError naming the response."""
        path = self._path(response_id)
        if path is None:
            return None
        try:
            return parse_record(read_json_bounded(path, MAX_RECORD_BYTES, "response"), f"response {response_id}")
        except FileNotFoundError:
            return None
        except FormatError as exc:  # our own file, damaged: not the client's error
            raise CorruptionError(f"stored response {response_id}: {exc}") from None

    def delete(self, response_id: str) -> bool:
        """Remove the record durably; True if it was there."""
        path = self._path(response_id)
        return path is not None and unlink_durably(path)


def responses_usage(out: TurnOutcome) -> dict[str, Any]:
    """The Responses API's ``usage``; ``cached_tokens``: the prompt's tokens reused from the session."""
    return {"input_tokens": out.prompt_tokens, "input_tokens_details": {"cached_tokens": out.reused_prefix},
            "output_tokens": len(out.tokens), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": out.prompt_tokens + len(out.tokens)}


CHAIN_PREFIX = "chain-"  # the ids of the sessions the Responses API makes for its chains


def chain_session_id() -> str:
    """A fresh id for a session holding a chain (or a branch of one)."""
    return f"{CHAIN_PREFIX}{secrets.token_hex(16)}"


def is_chain_session(session_id: str) -> bool:
    """Whether ``session_id`` names a session the Responses API made for a chain (its
    ``previous_response_id`` turns), not one a client named."""
    return session_id.startswith(CHAIN_PREFIX) and len(session_id) == len(CHAIN_PREFIX) + 32


def finish_record(record: ResponseRecord, out: TurnOutcome) -> None:
    """Fill ``record`` with the finished turn ``out``: its text, tokens, status and usage."""
    record.output_text, record.output_tokens = out.text, list(out.tokens)
    record.status = "completed" if out.finish == "stop" else "incomplete"
    record.incomplete_reason = {"length": "max_output_tokens", "abort": "interrupted"}.get(out.finish)
    record.usage = responses_usage(out)


__all__ = ["CHAIN_PREFIX", "CONVERSATION_SCHEMA", "MAX_RECORD_BYTES", "RESPONSES_DIR", "RESPONSE_ID", "ResponseRecord",
           "ResponseRecords", "chain_session_id", "finish_record", "is_chain_session", "is_response_id",
           "new_response_id", "parse_record", "responses_usage"]
