"""The catalogue's SQLite file (FORMAT.md 5.9): its tables (``sessions``, ``meta``, ``intents`` and
``totals`` with the triggers that keep it), the connection's settings (WAL, ``synchronous=NORMAL``,
the busy timeout, the WAL size limit) and the format check, with the in-place upgrade of a format-3
file (or an empty one) to format 4: the ``totals`` summed from its rows, in one transaction.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

from sessionstore.sessions.catalogue_entry import STATES
from sessionstore.sessions.paths import check_component

CATALOGUE_NAME = "catalogue.sqlite3"  # <root>/catalogue.sqlite3 (+ -wal, -shm while open)
CATALOGUE_FORMAT = 4  # PRAGMA user_version; another value: rebuilt (2: pinned; 3: bytes of the whole directory)
UPGRADED_IN_PLACE = (0, 3)  # an empty file, or format 3: given the totals (4) from its rows, once
WAL_LIMIT_BYTES = 4 << 20  # the WAL file is cut back to this after a checkpoint
BUSY_TIMEOUT_MS = 10_000  # another process's write transaction is waited for this long

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, model TEXT NOT NULL, fingerprint TEXT NOT NULL, kv_dtype TEXT NOT NULL,
    committed INTEGER NOT NULL, tokens INTEGER NOT NULL, bytes INTEGER NOT NULL,
    state TEXT NOT NULL, holder TEXT, last_use TEXT NOT NULL, retention_s INTEGER,
    pinned INTEGER NOT NULL, location TEXT NOT NULL, error TEXT) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS intents (id TEXT NOT NULL, owner TEXT NOT NULL,
    PRIMARY KEY (id, owner)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS totals (state TEXT PRIMARY KEY, sessions INTEGER NOT NULL,
    bytes INTEGER NOT NULL) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS totals_insert AFTER INSERT ON sessions BEGIN
    UPDATE totals SET sessions = sessions + 1, bytes = bytes + NEW.bytes WHERE state = NEW.state; END;
CREATE TRIGGER IF NOT EXISTS totals_delete AFTER DELETE ON sessions BEGIN
    UPDATE totals SET sessions = sessions - 1, bytes = bytes - OLD.bytes WHERE state = OLD.state; END;
CREATE TRIGGER IF NOT EXISTS totals_update AFTER UPDATE OF state, bytes ON sessions BEGIN
    UPDATE totals SET sessions = sessions - 1, bytes = bytes - OLD.bytes WHERE state = OLD.state;
    UPDATE totals SET sessions = sessions + 1, bytes = bytes + NEW.bytes WHERE state = NEW.state; END;
"""
_TOTALS_FROM_ROWS = """
DELETE FROM totals;
INSERT INTO totals (state, sessions, bytes) SELECT state, count(*), sum(bytes) FROM sessions GROUP BY state;
"""
_ZERO_TOTALS = "".join(f"INSERT OR IGNORE INTO totals (state, sessions, bytes) VALUES ('{state}', 0, 0);"
                       for state in STATES)


def check_catalogue_paths(path: Path) -> None:
    """Refuse (FormatError) a catalogue, WAL or shared-memory file at ``path`` that is a symlink or
    not a regular file: SQLite would follow it out of the store (FORMAT.md 5.1)."""
    for suffix in ("", "-wal", "-shm"):
        check_component(Path(str(path) + suffix), want="file")


def connect_catalogue(where: str) -> sqlite3.Connection:
    """A connection to the catalogue file ``where`` (or ``:memory:``) in WAL mode with the
    catalogue's settings, a format-3 or empty file upgraded to :data:`CATALOGUE_FORMAT` in place;
    sqlite3.DatabaseError for another format, sqlite3.OperationalError when WAL is refused."""
    db = sqlite3.connect(where, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                         check_same_thread=False)
    try:
        db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if where != ":memory:":
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"journal_mode {mode}, WAL refused")
        db.execute("PRAGMA synchronous = NORMAL")  # WAL: a killed process loses nothing committed
        db.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT_BYTES}")  # the WAL shrinks back after a rebuild
        db.execute("PRAGMA recursive_triggers = ON")  # INSERT OR REPLACE's delete keeps the totals too
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (*UPGRADED_IN_PLACE, CATALOGUE_FORMAT):
            raise sqlite3.DatabaseError(f"catalogue format {version}, this reads {CATALOGUE_FORMAT}")
        if version != CATALOGUE_FORMAT:  # one transaction (idempotent: a second opener redoes it)
            db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} {_TOTALS_FROM_ROWS} {_ZERO_TOTALS} "
                             f"PRAGMA user_version = {CATALOGUE_FORMAT}; COMMIT;")
    except sqlite3.Error:
        db.close()
        raise
    return db


__all__ = ["BUSY_TIMEOUT_MS", "CATALOGUE_FORMAT", "CATALOGUE_NAME", "UPGRADED_IN_PLACE", "WAL_LIMIT_BYTES",
           "check_catalogue_paths", "connect_catalogue"]
