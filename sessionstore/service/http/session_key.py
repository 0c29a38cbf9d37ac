"""The session a turn names: one key, three spellings (the body's ``session``, its ``session_id``,
SGLang's name, and the ``X-Session-Id`` header a load balancer routes on; FORMAT.md 7.2)."""
from __future__ import annotations

from sessionstore.service.errors import ApiError
from sessionstore.sessions import validate_session_id

SESSION_HEADER = "x-session-id"  # names a turn's session beside the body's "session" (FORMAT.md 7.2)


def session_of(body: dict[str, str | None], header: str | None) -> str | None:
    """The session a turn names, checked: the body's keys (``session``, ``session_id``: SGLang's
    name; one meaning) or the ``X-Session-Id`` header. Two of them naming different sessions is a
    400 naming both."""
    named = [(f"the body's {field}", field, value) for field, value in body.items() if value is not None]
    if header is not None:
        named.append(("the X-Session-Id header", "X-Session-Id", header))
    if not named:
        return None
    first, _, session = named[0]
    for label, param, value in named[1:]:
        if value != session:
            raise ApiError(400, f"{first} and {label} name different sessions ({session[:80]!r} and "
                           f"{value[:80]!r}); give one of them, or the same id", param=param,
                           code="session_mismatch")
    validate_session_id(session)
    return session


__all__ = ["SESSION_HEADER", "session_of"]
