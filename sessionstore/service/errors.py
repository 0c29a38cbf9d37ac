"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.

:func:`api_error_of` maps the store's own errors (kernels.errors) onto statuses, so a handler
never lets a traceback reach a client. No message a client reads names a server path
(:func:`scrub_paths`): the server's own places are named by what they are, any other absolute
path is ``<path>``.
"""
from __future__ import annotations

import errno
import os
import re
from collections.abc import Sequence
from typing import Any

from kernels.errors import (
    ColiError,
    CorruptionError,
    FormatError,
    LimitError,
    LockedError,
    ModelMismatchError,
    NotFoundError,
    UnsupportedModelError,
)
from sessionstore.sessions import SessionFencedError, SessionOffloadedError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 408: "timeout_error",
               409: "conflict_error", 413: "invalid_request_error", 500: "server_error",
               503: "service_unavailable", 507: "server_error"}
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a write the store's disk (or quota) had no room for: 507


# an absolute path of two or more components, not an API route (/v1/...) and not inside a URL
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~>])/(?!v1/)[\w.@+~-]+(?:/[\w.@+~-]*)+")

Places = Sequence[tuple[str, str]]  # (a server path, what to call it in a message)


def server_places(named: dict[str, str | None]) -> list[tuple[str, str]]:
    """``(path, label)`` pairs for :func:`scrub_paths`, from ``{label: path}`` (None skipped; a
    bare name without a separator, like the embedded model "tiny", is no path and is skipped),
    each path as given and resolved, longest first."""
    places: dict[str, str] = {}
    for label, path in named.items():
        if not path or os.sep not in path:
            continue
        for form in {path.rstrip(os.sep), os.path.realpath(path), os.path.abspath(path)}:
            if len(form) > 1:
                places.setdefault(form, label)
    return sorted(places.items(), key=lambda item: -len(item[0]))


def scrub_paths(message: str, places: Places = ()) -> str:
    """``message`` with each of ``places`` replaced by its label and any other absolute path by
    ``<path>``: an error never tells a client where the server keeps its files."""
    for path, label in places:
        message = message.replace(path, label)
    return _ABSOLUTE_PATH.sub("<path>", message)


class ApiError(Exception):
    """One refusal: an HTTP status and the message a client reads."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self, places: Places = ()) -> dict[str, Any]:
        """The JSON a client reads (its message through :func:`scrub_paths`)."""
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": scrub_paths(self.message, places), "type": kind, "param": self.param,
                          "code": self.code}}


def api_error_of(exc: BaseException) -> ApiError:
    """The API error for an exception raised while serving a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, SessionFencedError):
        return ApiError(503, f"{exc}; ask again to reopen it", code="session_fenced")
    if isinstance(exc, NotFoundError):
        return ApiError(404, str(exc), code="not_found")
    if isinstance(exc, SessionOffloadedError):
        return ApiError(409, str(exc), code="session_offloaded")
    if isinstance(exc, ModelMismatchError):
        return ApiError(409, str(exc), code="model_mismatch")
    if isinstance(exc, LockedError):
        return ApiError(409, str(exc), code="session_locked")
    if isinstance(exc, LimitError):
        return ApiError(400, str(exc), code="limit_exceeded")
    if isinstance(exc, (FormatError, UnsupportedModelError)):
        return ApiError(400, str(exc), code="invalid_value")
    if isinstance(exc, CorruptionError):
        return ApiError(500, str(exc), code="corruption")
    if isinstance(exc, ColiError):
        return ApiError(400, str(exc))
    if isinstance(exc, OSError) and exc.errno in DISK_FULL:
        return ApiError(507, "the store's disk is full (no space left for the session's records); what the turn "
                        "had committed is kept, and turns work again once space is freed", code="insufficient_storage")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}")


__all__ = ["ApiError", "ERROR_TYPES", "Places", "api_error_of", "scrub_paths", "server_places"]
