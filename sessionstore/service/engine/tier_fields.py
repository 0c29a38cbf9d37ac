"""The tier fields of a session's description (FORMAT.md 7, 5.10: ``state`` ``offloaded``,
``retention_seconds``, ``pinned``), built in the engine core where the sessions live."""
from __future__ import annotations

from typing import Any

from kernels.errors import ColiError
from sessionstore.sessions import CatalogueEntry, read_tier


def entry_tier_fields(entry: CatalogueEntry) -> dict[str, Any]:
    """The tier fields of a listed session (from its catalogue row)."""
    out: dict[str, Any] = {"retention_seconds": entry.retention_s, "pinned": entry.pinned}
    if entry.state == "offloaded":
        out.update(state="offloaded", location=entry.location)
    return out


def session_tier_fields(engine: Any, sid: str) -> dict[str, Any]:
    """The tier fields of one session (from its tier record)."""
    try:
        record = read_tier(engine.store.session_dir(sid))
    except ColiError:
        return {}
    out: dict[str, Any] = {"retention_seconds": record.retention_seconds, "pinned": record.pinned}
    if record.offloaded is not None:
        out.update(state="offloaded", location=record.offloaded.location, bytes=record.offloaded.bytes)
    return out


__all__ = ["entry_tier_fields", "session_tier_fields"]
