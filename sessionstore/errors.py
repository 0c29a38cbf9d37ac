"""Errors of the store; all derive from :class:`kernels.errors.ColiError`."""
from kernels.errors import (
    BackendUnavailableError,
    ColiError,
    CorruptionError,
    FormatError,
    LimitError,
    LockedError,
    ModelMismatchError,
    NotFoundError,
    UnsupportedModelError,
)

__all__ = [
    "BackendUnavailableError",
    "ColiError",
    "CorruptionError",
    "FormatError",
    "LimitError",
    "LockedError",
    "ModelMismatchError",
    "NotFoundError",
    "UnsupportedModelError",
]
