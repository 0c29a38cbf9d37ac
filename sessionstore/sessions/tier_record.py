"""A session's tier record (FORMAT.md 5.10): ``sessions/<id>/tier.json``, a small JSON file
replaced atomically, that holds what the store's tiers need and the manifest does not:

- ``retention_seconds``: the session is deleted (here and from the object store) this long after
  its last use; null: kept until deleted;
- ``pinned``: never offloaded, never expired;
- ``offloaded``: null while the session's files are here; else where its bundle lies in the
  object store, written BEFORE the local kv file is removed (the directory then keeps its manifest,
  its commit state page and this record: a stub that lists the session as ``offloaded``).

A session without the file has the defaults (kept until deleted, not pinned, local). Its last use
is not here: it is the manifest's ``updated_at`` (each commit writes it, FORMAT.md 5.5).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kernels.errors import ColiError, FormatError, LimitError
from kernels.jsonfile import parse_json_bytes
from sessionstore.kvfile import atomic_replace, open_regular, readable_temp

TIER_NAME = "tier.json"
TIER_SCHEMA = "coli-session-tier"
TIER_VERSION = 1
MAX_TIER_BYTES = 64 << 10  # a tier record is a few hundred bytes; more is refused before parsing
MAX_RETENTION_S = 10 * 366 * 86400  # ten years: longer is a mistake (use no retention: kept until deleted)


class SessionOffloadedError(ColiError):
    """The session is offloaded (its kv file is in the object store, FORMAT.md 5.10): what needs
    its records waits for a turn to restore it."""


@dataclass(frozen=True)
class Offloaded:
    """Where an offloaded session's bundle lies, and what left this disk."""

    url: str  # the object store's s3://bucket/prefix
    bundle: str  # the bundle's key in the bucket (the lease's pointer when it was offloaded)
    bytes: int  # the kv file's size removed from this disk
    tokens: int  # committed records the bundle holds
    at: str  # ISO-8601 UTC when the local files were removed

    @property
    def location(self) -> str:
        """``s3://bucket/key`` of the bundle (the catalogue's ``location``)."""
        bucket = self.url.removeprefix("s3://").split("/", 1)[0]
        return f"s3://{bucket}/{self.bundle}"


@dataclass(frozen=True)
class TierRecord:
    """What ``tier.json`` holds (the defaults when it is absent)."""

    retention_seconds: int | None = None
    pinned: bool = False
    offloaded: Offloaded | None = None

    def encode(self) -> bytes:
        doc: dict[str, Any] = {"schema": TIER_SCHEMA, "version": TIER_VERSION,
                               "retention_seconds": self.retention_seconds, "pinned": self.pinned,
                               "offloaded": None if self.offloaded is None else self.offloaded.__dict__}
        return json.dumps(doc, sort_keys=True).encode() + b"\n"

    def restored(self) -> TierRecord:
        """The same settings, local again."""
        return replace(self, offloaded=None)


@dataclass(frozen=True)
class TierChange:
    """What a request or ``PATCH /v1/sessions/{id}`` asks of a session's tier record: a new
    retention (``retention_given``; None clears it) and/or pin (None: unchanged)."""

    retention_given: bool = False
    retention_seconds: int | None = None
    pinned: bool | None = None

    def __bool__(self) -> bool:
        return self.retention_given or self.pinned is not None

    def apply(self, record: TierRecord) -> TierRecord:
        """``record`` with this change."""
        if self.retention_given:
            record = replace(record, retention_seconds=self.retention_seconds)
        if self.pinned is not None:
            record = replace(record, pinned=self.pinned)
        return record


def check_retention(value: object, where: str = "retention_seconds") -> int | None:
    """``value`` as a retention (an integer of seconds, 1 .. MAX_RETENTION_S, or None); else
    LimitError / FormatError naming ``where``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{where} must be an integer number of seconds or null, found {value!r}")
    if not 1 <= value <= MAX_RETENTION_S:
        raise LimitError(f"{where} must be from 1 to {MAX_RETENTION_S} seconds, found {value}")
    return value


def _offloaded_of(doc: object, where: str) -> Offloaded | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: offloaded must be an object or null")
    try:
        out = Offloaded(url=doc["url"], bundle=doc["bundle"], bytes=doc["bytes"], tokens=doc["tokens"], at=doc["at"])
    except KeyError as exc:
        raise FormatError(f"{where}: offloaded lacks {exc.args[0]!r}") from None
    if not all(isinstance(v, str) for v in (out.url, out.bundle, out.at)) or not out.url.startswith("s3://"):
        raise FormatError(f"{where}: offloaded url, bundle and at must be strings (url s3://...)")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (out.bytes, out.tokens)):
        raise FormatError(f"{where}: offloaded bytes and tokens must be integers >= 0")
    return out


def decode_tier(raw: bytes, where: str) -> TierRecord:
    """Parse and check a tier record (FormatError naming ``where`` and what is wrong)."""
    doc = parse_json_bytes(raw, where, "tier record")
    if not isinstance(doc, dict) or doc.get("schema") != TIER_SCHEMA:
        raise FormatError(f"{where}: not a tier record (schema {TIER_SCHEMA!r} expected)")
    if doc.get("version") != TIER_VERSION:
        raise FormatError(f"{where}: tier record version {doc.get('version')!r}, this reads {TIER_VERSION}")
    pinned = doc.get("pinned", False)
    if not isinstance(pinned, bool):
        raise FormatError(f"{where}: pinned must be true or false")
    try:
        retention = check_retention(doc.get("retention_seconds"), f"{where}: retention_seconds")
    except LimitError as exc:
        raise FormatError(str(exc)) from None
    return TierRecord(retention, pinned, _offloaded_of(doc.get("offloaded"), where))


def read_tier(session_dir: str | os.PathLike[str]) -> TierRecord:
    """The tier record of the session in ``session_dir`` (the defaults when there is none);
    never follows a symlink; bounded read."""
    path = os.path.join(os.fspath(session_dir), TIER_NAME)
    try:
        fd = open_regular(path, os.O_RDONLY | os.O_NONBLOCK, what="tier record")
    except FileNotFoundError:
        return TierRecord()
    except OSError as exc:
        raise FormatError(f"{path}: cannot open the tier record ({exc.strerror})") from None
    try:
        raw = os.pread(fd, MAX_TIER_BYTES + 1, 0)
    finally:
        os.close(fd)
    if len(raw) > MAX_TIER_BYTES:
        raise FormatError(f"{path}: tier record larger than {MAX_TIER_BYTES} bytes")
    return decode_tier(raw, path)


def write_tier(session_dir: str | os.PathLike[str], record: TierRecord) -> None:
    """Replace ``sessions/<id>/tier.json`` atomically and durably (temp, fsync, rename, fsync dir)."""
    path = Path(session_dir) / TIER_NAME
    atomic_replace(path, record.encode(), make_temp=readable_temp(".tier-"), durable=True)


def refuse_offloaded(session_dir: str | os.PathLike[str], session_id: str) -> None:
    """Raise SessionOffloadedError when the session in ``session_dir`` is an offloaded stub."""
    if is_offloaded(session_dir):
        raise SessionOffloadedError(f"session {session_id!r} is offloaded to the object store: its records are not "
                                    "on this disk until a turn on it restores it")


def is_offloaded(session_dir: str | os.PathLike[str]) -> bool:
    """Whether the session in ``session_dir`` is an offloaded stub (a damaged record: False)."""
    try:
        return read_tier(session_dir).offloaded is not None
    except FormatError:
        return False


__all__ = ["MAX_RETENTION_S", "MAX_TIER_BYTES", "TIER_NAME", "Offloaded", "SessionOffloadedError", "TierChange",
           "TierRecord", "refuse_offloaded", "check_retention",
           "decode_tier", "is_offloaded", "read_tier", "write_tier"]
