"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.

:func:`api_error_of` maps the store's own errors (kernels.errors) onto statuses, so a handler
never lets a traceback reach a client.
"""
from __future__ import annotations

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

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               409: "conflict_error", 413: "invalid_request_error", 500: "server_error",
               503: "service_unavailable"}


class ApiError(Exception):
    """One refusal: an HTTP status and the message a client reads."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def api_error_of(exc: BaseException) -> ApiError:
    """The API error for an exception raised while serving a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, NotFoundError):
        return ApiError(404, str(exc), code="not_found")
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
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}")


__all__ = ["ApiError", "ERROR_TYPES", "api_error_of"]
