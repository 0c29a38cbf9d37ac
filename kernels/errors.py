"""The error hierarchy shared by every package (kernels holds it: it imports nothing of ours)."""
from __future__ import annotations


class ColiError(Exception):
    """Base of every error this project raises on purpose; the CLI prints it as one line."""

    exit_code: int = 2


class FormatError(ColiError, ValueError):
    """Bytes that are not what the format allows (bad magic, impossible dims, short header)."""


class CorruptionError(ColiError):
    """Data that was once sound no longer is (checksum mismatch, torn middle)."""

    exit_code = 3


class ChecksumMismatchError(CorruptionError):
    """Records that fail the checksums vouching for them (a sidecar's): refused, never used."""

    def __init__(self, message: str, records: int) -> None:
        super().__init__(message)
        self.records = records  # how many records failed their checksums


class LimitError(ColiError, ValueError):
    """A declared size or count exceeds a named limit; refused before any allocation."""


class ModelMismatchError(ColiError):
    """A file, session or bundle belongs to another model (dims, vocab or fingerprint)."""


class UnsupportedModelError(ColiError, ValueError):
    """A checkpoint whose config this project does not implement (refused by name)."""


class LockedError(ColiError):
    """Another writer holds the lock on this file or session."""

    exit_code = 4


class NotFoundError(ColiError, KeyError, FileNotFoundError):
    """A session, slot or file that does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; we want plain text
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(ColiError, RuntimeError):
    """A compute backend (CUDA/cupy) was asked for but cannot be used here."""
