"""A conversation's id (FORMAT.md 7.5): a conversation is a session, so its id is a session id
(``conv_`` and 48 hex digits when the API makes one), checked where a request names it."""
from __future__ import annotations

import secrets

from kernels.errors import ColiError
from sessionstore.service.errors import ApiError
from sessionstore.sessions import validate_session_id


def new_conversation_id() -> str:
    """A fresh conversation id (and so session id): ``conv_`` and 48 hex digits."""
    return "conv_" + secrets.token_hex(24)


def is_session_id(value: object) -> bool:
    try:
        validate_session_id(value)
    except ColiError:
        return False
    return True


def conversation_not_found(conversation_id: str) -> ApiError:
    return ApiError(404, f"no conversation {conversation_id[:80]!r}", param="conversation_id",
                    code="conversation_not_found")


__all__ = ["conversation_not_found", "is_session_id", "new_conversation_id"]
