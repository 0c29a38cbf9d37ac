"""A session's messages for ``GET /v1/sessions/{id}?messages=1``, read from its committed files.

The answer never waits for, nor holds up, a turn in flight: it reads ``conversation.json`` and the
committed history (manifest + kv token column, no lock) and gives messages only when they describe
exactly that history (FORMAT.md 5.8), so they are never stale:

- no open turn: the messages, if the file names the history's length and digest;
- an open turn whose prompt is not yet committed (the history is still the complete messages'):
  the complete messages (``turn_unfed``);
- an open turn whose prompt the history starts with: the turn's messages and the reply committed
  so far as an assistant message (``turn_partial``; what recovery would close the turn with).

Anything else (no file, a history changed by token-level commands, a prompt only partly fed) is
``messages: null`` with a reason. The file is read before and after the history; if the two reads
differ, a turn wrote it meanwhile and the read is tried again.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernels.errors import FormatError, LimitError
from sessionstore.sessions import ConversationRecord, read_record, tokens_digest

READ_ATTEMPTS = 4
Decode = Callable[[list[int]], str]


@dataclass
class SessionMessages:
    """The messages of one session (or None) and the state they describe, or why there are none."""

    messages: list[dict[str, Any]] | None
    state: str | None = None  # "complete" | "turn_unfed" | "turn_partial"; None when messages is None
    code: str | None = None
    reason: str | None = None

    def fields(self) -> dict[str, Any]:
        why = None if self.code is None else {"code": self.code, "message": self.reason}
        return {"messages": self.messages, "messages_state": self.state, "messages_reason": why}


def _none(code: str, reason: str) -> SessionMessages:
    return SessionMessages(None, None, code, reason)


def judge(record: ConversationRecord, history: list[int], decode: Decode | None) -> SessionMessages:
    """The messages ``record`` gives for the committed ``history`` (FORMAT.md 5.8's recovery rules)."""
    turn = record.turn
    if turn is None:
        if record.agrees_with(history):
            return SessionMessages([dict(m) for m in record.messages], "complete")
        return _none("conversation_mismatch",
                     f"the conversation file stands for {record.tokens} tokens that are not the session's "
                     f"{len(history)} committed tokens (changed by token-level commands)")
    n = turn.prompt_tokens
    if len(history) >= n and tokens_digest(history[:n]) == turn.prompt_digest:
        if decode is None:
            return _none("no_tokenizer", "a turn is open and this server has no tokenizer to decode its reply")
        reply = {"role": "assistant", "content": decode(history[n:])}
        return SessionMessages([*(dict(m) for m in turn.messages), reply], "turn_partial")
    if record.agrees_with(history):
        return SessionMessages([dict(m) for m in record.messages], "turn_unfed")
    if len(history) < n:
        return _none("turn_incomplete",
                     f"a turn is open and only {len(history)} of its prompt's {n} tokens are committed (being "
                     "fed now, or cut while being fed: the session's next chat turn completes it)")
    return _none("conversation_mismatch",
                 "the committed tokens are neither the conversation's nor its open turn's")


def read_messages(directory: Any, history: Callable[[], list[int]], decode: Decode | None) -> SessionMessages:
    """The messages of the session in ``directory`` whose committed history ``history()`` reads."""
    try:
        for _ in range(READ_ATTEMPTS):
            before = read_record(directory)
            if before is None:
                return _none("no_conversation", "the session has no conversation file (its tokens came from "
                             "the completions API or token-level commands, or a fork cut inside a conversation)")
            tokens = history()
            if read_record(directory) == before:
                return judge(before, tokens, decode)
    except (FormatError, LimitError) as exc:
        return _none("conversation_unreadable", str(exc))
    return _none("conversation_changing", f"the conversation file changed during each of {READ_ATTEMPTS} reads "
                 "(a turn is writing it); ask again")


def session_messages(engine: Any, session_id: str) -> dict[str, Any]:
    """The response fields ``messages``, ``messages_state`` and ``messages_reason`` of one session."""
    tok = engine.runner.tok
    decode = None if tok is None else tok.decode
    store = engine.store
    return read_messages(store.session_dir(session_id), lambda: store.history(session_id), decode).fields()


__all__ = ["READ_ATTEMPTS", "SessionMessages", "judge", "read_messages", "session_messages"]
