"""The catalogue's one SQLite connection behind one lock (FORMAT.md 5.9): :class:`CatalogueDb`.

It runs the catalogue's transactions (``BEGIN IMMEDIATE``, rolled back on any error), reads and
writes its stamp (the ``sessions/`` directory's mtime and when it was recorded, in ``meta``), and
swaps its connection: to an in-memory catalogue where the file cannot be used, or to a new file
where the old one was damaged (kept aside as ``catalogue.sqlite3.damaged``). What the rows mean
and when the catalogue is rebuilt is :class:`~sessionstore.sessions.catalogue.Catalogue`'s.
"""
from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sessionstore.sessions.catalogue_schema import connect_catalogue

STAMP_KEY = "sessions_mtime_ns"  # meta: the sessions/ directory's mtime the rows are true to
STAMPED_AT_KEY = "stamped_at"  # meta: when that stamp was recorded (time.time())


def replace_damaged_file(path: Path) -> sqlite3.Connection:
    """Move a damaged catalogue at ``path`` aside (``<path>.damaged``; its -wal and -shm
    removed) and connect to a new, empty one there."""
    for suffix in ("-wal", "-shm"):
        try:
            os.unlink(str(path) + suffix)
        except FileNotFoundError:
            pass
    try:
        os.replace(path, str(path) + ".damaged")
    except FileNotFoundError:
        pass
    return connect_catalogue(str(path))


class CatalogueDb:
    """``conn``, the connection to the catalogue at ``path`` (or in memory), and ``lock``, held by
    whoever uses it (thread-safe: one connection, one re-entrant lock)."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self.conn = conn
        self.lock = threading.RLock()

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    def use_memory(self) -> None:
        """Close the file and go on with an empty in-memory catalogue (the file cannot be used now)."""
        with self.lock:
            self.conn.close()
            self.conn = connect_catalogue(":memory:")

    def replace_damaged(self) -> None:
        """Close the damaged file (quietly), move it aside and connect to a new, empty one."""
        with self.lock:
            try:
                self.conn.close()
            except sqlite3.Error:
                pass
            self.conn = replace_damaged_file(self.path)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection inside ``BEGIN IMMEDIATE`` .. ``COMMIT`` (``ROLLBACK`` on any error),
        under the lock."""
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    def meta(self, key: str) -> str | None:
        """The ``meta`` row ``key`` (None when absent); the caller holds the lock."""
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def stamp(self, mtime_ns: int, at: float) -> None:
        """Record ``sessions/``'s mtime and when it was read; inside a transaction."""
        self.conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                              [(STAMP_KEY, str(mtime_ns)), (STAMPED_AT_KEY, repr(at))])


__all__ = ["STAMPED_AT_KEY", "STAMP_KEY", "CatalogueDb", "replace_damaged_file"]
