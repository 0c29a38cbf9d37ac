"""A session's conversation file: the messages its tokens were rendered from (``conversation.json``).

The file sits beside the manifest and is always replaced whole (temp -> fsync -> rename -> fsync
directory). It names the token history it stands for by length and SHA-256 (of the ids as
little-endian int32), so a reader can tell whether it agrees with the committed tokens. A turn
in progress is recorded BEFORE its prompt reaches the kv file (``turn``: the messages being
answered and the length + digest of their rendered prompt); see :mod:`conversation_chat` for
the write order and the recovery rules that follow from it.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kernels.errors import FormatError
from kernels.jsonfile import read_json_bounded
from kernels.model.sampling import Sampler
from sessionstore.kvfile import atomic_replace, readable_temp, unlink_durably

CONVERSATION_NAME = "conversation.json"
SCHEMA = "coli-session-conversation"
SCHEMA_VERSION = 1
MAX_CONVERSATION_BYTES = 32 << 20
MAX_MESSAGES = 1 << 16
ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def tokens_digest(tokens: Sequence[int] | np.ndarray) -> str:
    """SHA-256 hex of the ids as little-endian int32 (the kv file's token column)."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """An OpenAI-style message list (role + string content, other JSON fields kept), checked."""
    if not isinstance(messages, list):
        raise FormatError(f"{where}: messages must be a JSON list of objects")
    if len(messages) > MAX_MESSAGES:
        raise FormatError(f"{where}: more than {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise FormatError(f"{where}: message {i} must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise FormatError(f"{where}: message {i} has role {role!r}; expected one of {sorted(ROLES)}")
        if not isinstance(content, str):
            raise FormatError(f"{where}: message {i} needs a string 'content'")
        out.append(dict(m))
    return out


def sampler_json(sampler: Sampler | None) -> dict[str, Any] | None:
    """The settings as recorded (FORMAT.md 5.8): the four draw settings, and the logits-processing
    settings that are not the defaults (files written before them, and turns without, lack them)."""
    return None if sampler is None else sampler.to_dict()


def parse_sampler(obj: dict[str, Any], where: str) -> Sampler | None:
    """The optional ``sampler`` field of a record or turn (absent in files written before it)."""
    value = obj.get("sampler")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FormatError(f"{where}: sampler must be an object or null")
    try:
        return Sampler.from_dict(value)
    except FormatError as exc:
        raise FormatError(f"{where}: sampler: {exc}") from None


def parse_response_format(obj: dict[str, Any], where: str) -> dict[str, Any] | None:
    """The optional ``response_format`` field of a record or turn (absent: none recorded)."""
    value = obj.get("response_format")
    if value is not None and not (isinstance(value, dict) and isinstance(value.get("type"), str)):
        raise FormatError(f"{where}: response_format must be an object with a string 'type', or null")
    return value


@dataclass
class OpenTurn:
    """A turn whose prompt may be (partly) in the kv file and whose answer is not yet a message."""

    messages: list[dict[str, Any]]  # the conversation being answered (ends with the new prompt)
    prompt_tokens: int
    prompt_digest: str
    sampler: Sampler | None = None  # what the reply is drawn with (None: not recorded)
    response_format: dict[str, Any] | None = None  # the grammar it is drawn under (None: free text)
    spliced: int | None = None  # the prompt's first ids are the history's first this many (chat_splice)

    def to_json(self) -> dict[str, Any]:
        fmt = {} if self.response_format is None else {"response_format": self.response_format}
        kept = {} if self.spliced is None else {"spliced": self.spliced}
        return {"messages": self.messages, "prompt_tokens": self.prompt_tokens, "prompt_digest": self.prompt_digest,
                "sampler": sampler_json(self.sampler), **fmt, **kept}


@dataclass
class ConversationRecord:
    """The file's content: complete messages, the history they stand for, an open turn or None."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    digest: str = field(default_factory=lambda: tokens_digest([]))
    turn: OpenTurn | None = None
    sampler: Sampler | None = None  # what the last assistant message was drawn with (None: not recorded)
    response_format: dict[str, Any] | None = None  # the grammar it was drawn under (None: free text)

    def agrees_with(self, history: Sequence[int]) -> bool:
        return len(history) == self.tokens and tokens_digest(history) == self.digest

    def encode(self) -> bytes:
        obj = {"schema": SCHEMA, "version": SCHEMA_VERSION, "messages": self.messages, "tokens": self.tokens,
               "digest": self.digest, "turn": None if self.turn is None else self.turn.to_json(),
               "sampler": sampler_json(self.sampler)}
        if self.response_format is not None:
            obj["response_format"] = self.response_format
        return (json.dumps(obj, ensure_ascii=False, indent=1) + "\n").encode("utf-8")


def _digest_field(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not (isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)):
        raise FormatError(f"{where}: {key} must be 64 lowercase hex digits")
    return value


def _count(obj: dict[str, Any], key: str, where: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FormatError(f"{where}: {key} must be an integer >= 0")
    return value


def parse_record(obj: Any, where: str) -> ConversationRecord:
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise FormatError(f"{where}: not a conversation file (schema {SCHEMA!r} expected)")
    if obj.get("version") != SCHEMA_VERSION:
        raise FormatError(f"{where}: conversation version {obj.get('version')!r} is not supported")
    turn = obj.get("turn")
    open_turn = None
    if turn is not None:
        if not isinstance(turn, dict):
            raise FormatError(f"{where}: turn must be an object or null")
        open_turn = OpenTurn(check_messages(turn.get("messages"), where), _count(turn, "prompt_tokens", where),
                             _digest_field(turn, "prompt_digest", where), parse_sampler(turn, where),
                             parse_response_format(turn, where),
                             None if turn.get("spliced") is None else _count(turn, "spliced", where))
    return ConversationRecord(check_messages(obj.get("messages"), where), _count(obj, "tokens", where),
                              _digest_field(obj, "digest", where), open_turn, parse_sampler(obj, where),
                              parse_response_format(obj, where))


def read_record(directory: str | os.PathLike[str]) -> ConversationRecord | None:
    """The session directory's conversation, or None when it has none."""
    path = Path(directory) / CONVERSATION_NAME
    try:
        obj = read_json_bounded(path, MAX_CONVERSATION_BYTES, "conversation")
    except FileNotFoundError:
        return None
    return parse_record(obj, str(path))


def write_record(directory: str | os.PathLike[str], record: ConversationRecord) -> None:
    """Replace the conversation file whole and durably (temp, fsync, rename, fsync directory)."""
    data = record.encode()
    if len(data) > MAX_CONVERSATION_BYTES:
        raise FormatError(f"the conversation is larger than {MAX_CONVERSATION_BYTES} bytes")
    atomic_replace(Path(directory) / CONVERSATION_NAME, data, make_temp=readable_temp(".conversation-"), durable=True)


def copy_record(src_dir: str | os.PathLike[str], dst_dir: str | os.PathLike[str],
                dst_history: Sequence[int]) -> bool:
    """Give a copied session (a fork) its source's conversation when it describes the copy's
    history exactly (a closed turn, same length and digest); True if copied. A fork cut
    elsewhere, or taken during a turn, starts without messages."""
    record = read_record(src_dir)
    if record is None or record.turn is not None or not record.agrees_with(dst_history):
        return False
    write_record(dst_dir, record)
    return True


def remove_record(directory: str | os.PathLike[str]) -> bool:
    """Remove the conversation file durably (tokens changed by a token-level command); True if one was there."""
    return unlink_durably(Path(directory) / CONVERSATION_NAME)


__all__ = ["CONVERSATION_NAME", "ConversationRecord", "MAX_CONVERSATION_BYTES", "OpenTurn", "check_messages",
           "copy_record", "parse_record", "parse_response_format", "parse_sampler", "read_record", "remove_record",
           "sampler_json", "tokens_digest", "write_record"]
