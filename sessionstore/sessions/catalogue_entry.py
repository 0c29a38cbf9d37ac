"""One session as the catalogue lists it (FORMAT.md 5.9): :class:`CatalogueEntry`, one row of the
``sessions`` table, and how it is read from the session's files (manifest, kv size, tier record),
which a rebuild, a reconcile, a change and a page of the listing all do.
"""
from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, fields, replace
from pathlib import Path

from kernels.errors import ColiError, NotFoundError
from sessionstore.sessions.disk_usage import session_disk_bytes
from sessionstore.sessions.manifest import MANIFEST_NAME, Manifest, read_manifest
from sessionstore.sessions.paths import KV_NAME, check_component
from sessionstore.sessions.tier_record import TierRecord, read_tier

STATES = ("resident", "suspended", "offloaded", "missing", "unreadable")  # a row's state
LOCAL = "local"  # the location of a session whose files are in this store's sessions/


@dataclass(frozen=True)
class CatalogueEntry:
    """One session as the catalogue lists it (one row of ``sessions``)."""

    id: str
    model: str  # display name ("" when the manifest cannot be read)
    fingerprint: str
    kv_dtype: str
    committed: int  # committed records
    tokens: int  # committed records + pending tokens
    bytes: int  # the session's files on disk (disk_usage; offloaded: the size its removal freed)
    state: str  # one of STATES
    holder: str | None  # owner token of the process holding it resident (state "resident")
    last_use: str  # ISO-8601 UTC: the manifest's updated_at (the last commit or whole write)
    retention_s: int | None  # seconds kept after last use (None: kept until deleted; tier.json)
    pinned: bool  # never offloaded or expired (tier.json)
    location: str  # LOCAL, or where an offloaded session's bundle lies (s3://bucket/key, tier.json)
    error: str | None  # why the state is "missing" or "unreadable"

    def same_files(self, other: CatalogueEntry) -> bool:
        """Whether both describe the same files (the fields a rebuild reads from them)."""
        return _file_fields(self) == _file_fields(other)


def _file_fields(e: CatalogueEntry) -> tuple[object, ...]:
    return (e.id, e.model, e.fingerprint, e.kv_dtype, e.committed, e.tokens, e.bytes, e.last_use, e.error,
            e.state in ("missing", "unreadable", "offloaded"), e.retention_s, bool(e.pinned), e.location)


def entry_of_row(row: tuple[object, ...] | sqlite3.Row) -> CatalogueEntry:
    """A row of ``sessions`` as an entry (SQLite keeps ``pinned`` as 0 or 1)."""
    entry = CatalogueEntry(*row)  # type: ignore[arg-type]
    return replace(entry, pinned=bool(entry.pinned))


COLUMNS = ", ".join(f.name for f in fields(CatalogueEntry))  # the sessions table's columns, in field order
PLACEHOLDERS = ", ".join("?" for _ in fields(CatalogueEntry))


def entry_of_manifest(manifest: Manifest, disk_bytes: int, *, state: str = "suspended",
                      holder: str | None = None, tier: TierRecord | None = None) -> CatalogueEntry:
    """The entry of a session whose manifest is ``manifest``, whose files take ``disk_bytes`` and
    tier record ``tier`` (None: the defaults; :meth:`Catalogue.note` keeps the row's)."""
    tier = tier or TierRecord()
    return CatalogueEntry(manifest.id, manifest.model.name, manifest.model.fingerprint, manifest.kv_dtype,
                          manifest.committed, manifest.committed + len(manifest.pending), disk_bytes, state,
                          holder, manifest.updated_at, tier.retention_seconds, tier.pinned,
                          LOCAL if tier.offloaded is None else tier.offloaded.location, None)


def problem_entry(session_id: str, state: str, error: str) -> CatalogueEntry:
    """The entry of a session whose files are gone (``missing``) or cannot be read (``unreadable``)."""
    return CatalogueEntry(session_id, "", "", "", 0, 0, 0, state, None, "", None, False, LOCAL, error)


def entry_from_files(sessions_root: Path, session_id: str) -> CatalogueEntry | None:
    """The entry ``sessions/<id>`` describes now (manifest with its state page, kv size, tier
    record); None when the directory is absent; state ``offloaded`` when its tier record says so
    (FORMAT.md 5.10: its kv file may be gone), ``missing`` when its manifest or kv file is,
    ``unreadable`` when its manifest or tier record fails FORMAT.md 5.3 / 5.10 or the directory is
    a symlink (not followed)."""
    d = sessions_root / session_id
    try:
        if not check_component(d, want="dir"):  # a symlink is refused (FormatError), never followed
            return None
        manifest = read_manifest(d / MANIFEST_NAME)
        if manifest.id != session_id:
            raise ColiError(f"{d / MANIFEST_NAME}: manifest id {manifest.id!r}, expected {session_id!r}")
        tier = read_tier(d)
        if tier.offloaded is not None:
            return entry_of_manifest(manifest, tier.offloaded.bytes, state="offloaded", tier=tier)
        os.lstat(d / KV_NAME)  # a session without its kv file is missing
        size = session_disk_bytes(d)
    except (NotFoundError, FileNotFoundError) as exc:
        if not os.path.lexists(d):
            return None
        return problem_entry(session_id, "missing", str(exc))
    except (ColiError, OSError) as exc:
        return problem_entry(session_id, "unreadable", str(exc))
    return entry_of_manifest(manifest, size, tier=tier)



__all__ = ["COLUMNS", "LOCAL", "PLACEHOLDERS", "STATES", "CatalogueEntry", "entry_from_files", "entry_of_manifest",
           "entry_of_row", "problem_entry"]
