"""The store's session catalogue (FORMAT.md 5.9): one SQLite file beside ``sessions/`` that lists
every session with its model, kv dtype, tokens, bytes, state, last use, retention and location,
so that start-up, a page of the listing and the lookup of one session cost the same in a store of
ten sessions and of 100,000.

The files stay the truth: the catalogue is a cache of them. Every change of ``sessions/`` by
the store is bracketed by an *intent* row (written before the change, removed in the same
transaction that applies the change's row), and a stamp (the ``sessions/`` directory's mtime)
says whether anything else changed it. On open the catalogue is used as it is when the stamp
matches and no intent is left; intents left by dead processes are replayed (their sessions
re-read); a stamp that does not match (or is too recent to tell, :data:`RACY_S`) costs a
comparison of the directory's names with the catalogue's; a missing, damaged or other-format
file is rebuilt from the manifests. A page checks the stamp too, and re-reads each of its sessions
from the files. Writes are SQLite transactions in WAL mode (``synchronous=NORMAL``): a process
killed mid-write leaves the last committed transaction.
"""
from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass, fields, replace
from pathlib import Path

from kernels.errors import FormatError, NotFoundError
from sessionstore.kvfile import current_owner, owner_of
from sessionstore.log import get_logger
from sessionstore.sessions.catalogue_db import STAMP_KEY, STAMPED_AT_KEY, CatalogueDb, replace_damaged_file
from sessionstore.sessions.catalogue_entry import (
    COLUMNS,
    PLACEHOLDERS,
    CatalogueEntry,
    entry_from_files,
    entry_of_row,
    problem_entry,
)
from sessionstore.sessions.catalogue_schema import CATALOGUE_NAME, check_catalogue_paths, connect_catalogue
from sessionstore.sessions.paths import is_valid_session_id
from sessionstore.sessions.tier_record import TierRecord

RACY_S = 2.0  # a stamp recorded less than this after the mtime it holds cannot vouch for it

log = get_logger("catalogue")


class SessionFilesMissingError(NotFoundError):
    """The catalogue lists the session but its files are gone: it is reported, never served."""


_TIER_COLUMNS = ("retention_s", "pinned", "location")  # from the tier record: a commit's note keeps them
_NOTED = ", ".join(f"{f.name} = excluded.{f.name}" for f in fields(CatalogueEntry)
                   if f.name not in ("id", *_TIER_COLUMNS))


@dataclass(frozen=True)
class CataloguePage:
    """One page of the listing: ``entries`` in the page's order; ``has_more`` when more follow."""

    entries: list[CatalogueEntry]
    has_more: bool


class Catalogue:
    """The SQLite catalogue of one store (thread-safe: one connection behind a lock).

    It keeps the file true to the directory (refresh, replay, reconcile, rebuild) and reads and
    writes the rows (note, forget, get, page, counts); the connection, its lock, transactions and
    stamp are its :class:`~sessionstore.sessions.catalogue_db.CatalogueDb`, the file itself
    (schema, upgrade) catalogue_schema and a row read from a session's files catalogue_entry."""

    def __init__(self, root: Path, sessions_root: Path) -> None:
        """Open ``<root>/catalogue.sqlite3`` for the sessions under ``sessions_root`` and bring it
        up to date (:meth:`refresh`); a store that cannot hold the file (read-only) gets an
        in-memory catalogue built from the manifests. ``self.opened`` says how it was brought
        up to date: ``fresh``, ``replayed`` (intents), ``reconciled`` (names; after a replay too),
        ``rebuilt``; ``self.replayed`` names the sessions whose intents were replayed."""
        self.path = root / CATALOGUE_NAME
        self.sessions_root = sessions_root
        self.opened = "fresh"
        self.replayed: list[str] = []  # the sessions whose intents the last refresh replayed
        try:
            check_catalogue_paths(self.path)
            self._db = CatalogueDb(self.path, connect_catalogue(str(self.path)))
        except (sqlite3.OperationalError, FormatError) as exc:  # cannot be opened or written here
            log.warning("catalogue.unusable", path=str(self.path), error=str(exc), action="in memory")
            self._db = CatalogueDb(self.path, connect_catalogue(":memory:"))
            self.opened = "rebuilt"
            self.rebuild()
            return
        except sqlite3.DatabaseError as exc:  # not a database, or of another format
            log.warning("catalogue.damaged", path=str(self.path), error=str(exc), action="rebuilt")
            self._db = CatalogueDb(self.path, replace_damaged_file(self.path))
            self.opened = "rebuilt"
            self.rebuild()
            return
        self.refresh()

    def close(self) -> None:
        self._db.close()

    # ---- freshness (FORMAT.md 5.9) -----------------------------------------------------------
    def refresh(self) -> str:
        """Bring the catalogue up to date with the files at the cost the rule allows; returns how
        (``fresh``, ``replayed``, ``reconciled``, ``rebuilt``), also kept in ``self.opened``."""
        try:
            with self._db.lock:
                self.opened = self._refresh()
        except sqlite3.OperationalError as exc:  # busy past the timeout, or cannot be written now
            log.warning("catalogue.unusable", path=str(self.path), error=str(exc), action="in memory")
            with self._db.lock:
                self._db.use_memory()
                self.rebuild()
            self.opened = "rebuilt"
        except sqlite3.DatabaseError as exc:  # damaged: it is a cache, made again from the files
            log.warning("catalogue.damaged", path=str(self.path), error=str(exc), action="rebuilt")
            with self._db.lock:  # moved aside (catalogue.sqlite3.damaged), then made again
                self._db.replace_damaged()
                self.rebuild()
            self.opened = "rebuilt"
        return self.opened

    def _refresh(self) -> str:
        self.replayed = []
        stamp = self._db.meta(STAMP_KEY)
        if stamp is None:
            self.rebuild()
            return "rebuilt"
        how = "fresh"
        for sid, token in self._db.conn.execute("SELECT id, owner FROM intents").fetchall():
            owner = owner_of(token)
            if owner is not None and owner.state() == "alive" and owner != current_owner():
                continue  # in flight in another process: it applies its own row
            self._apply(sid, intent_done=(sid, token))  # that process died between intent and row
            self.replayed.append(sid)
            how = "replayed"
        mtime, stamped_at = self._dir_mtime_ns(), float(self._db.meta(STAMPED_AT_KEY) or 0)
        if str(mtime) != stamp or stamped_at - mtime / 1e9 < RACY_S:
            self.reconcile()
            how = "reconciled"
        return how

    def _dir_mtime_ns(self) -> int:
        return os.lstat(self.sessions_root).st_mtime_ns

    def _names(self) -> list[str]:
        return [n for n in os.listdir(self.sessions_root) if is_valid_session_id(n)]

    def rebuild(self) -> int:
        """Every row again from the manifests (one transaction); returns the sessions listed."""
        at, mtime = time.time(), self._dir_mtime_ns()  # read BEFORE the scan: a change during it shows
        entries = [e for e in (entry_from_files(self.sessions_root, sid) for sid in self._names()) if e is not None]
        with self._db.transaction() as db:
            db.execute("DELETE FROM sessions")
            db.execute("DELETE FROM intents")
            db.executemany(f"INSERT INTO sessions ({COLUMNS}) VALUES ({PLACEHOLDERS})", map(astuple, entries))
            self._db.stamp(mtime, at)
        log.info("catalogue.rebuilt", path=str(self.path), sessions=len(entries))
        return len(entries)

    def reconcile(self) -> tuple[int, int]:
        """Compare the names under ``sessions/`` with the rows: a new name's row is read from its
        files; a row whose directory is gone is kept as ``missing`` (reported until deleted).
        Returns (added, missing)."""
        at, mtime = time.time(), self._dir_mtime_ns()
        names = set(self._names())
        with self._db.lock:
            listed = {sid: state for sid, state in self._db.conn.execute("SELECT id, state FROM sessions")}
        new = [e for e in (entry_from_files(self.sessions_root, sid) for sid in sorted(names - listed.keys()))
               if e is not None]
        gone = [sid for sid, state in listed.items() if sid not in names and state != "missing"]
        with self._db.transaction() as db:  # a change in flight meanwhile writes its own row after this
            db.executemany(f"INSERT OR IGNORE INTO sessions ({COLUMNS}) VALUES ({PLACEHOLDERS})",
                           [astuple(e) for e in new if os.path.lexists(self.sessions_root / e.id)])
            db.executemany("UPDATE sessions SET state = 'missing', holder = NULL, error = ? WHERE id = ?",
                           [(_gone(self.sessions_root, sid), sid) for sid in gone])
            self._db.stamp(mtime, at)
        if new or gone:
            log.warning("catalogue.reconciled", path=str(self.path), added=len(new), missing=len(gone))
        return len(new), len(gone)

    # ---- the store's changes of sessions/ ---------------------------------------------------------
    @contextmanager
    def changing(self, session_id: str) -> Iterator[None]:
        """Bracket a change of ``sessions/<id>`` (install, delete, replace): an intent before it,
        then the session's row read from its files (or removed when its directory is gone) and the
        intent dropped in one transaction. A catalogue write that fails is logged, never raised:
        the files are the truth and the next open replays what is left."""
        token = current_owner().token
        before: int | None = None
        try:
            with self._db.transaction() as db:
                db.execute("INSERT OR REPLACE INTO intents (id, owner) VALUES (?, ?)", (session_id, token))
                mtime = self._dir_mtime_ns()
                before = mtime if self._db.meta(STAMP_KEY) == str(mtime) else None
        except sqlite3.Error as exc:
            log.warning("catalogue.write_failed", id=session_id, error=str(exc), step="intent")
        try:
            yield
        finally:
            try:
                self._apply(session_id, intent_done=(session_id, token), stamp_if=before)
            except sqlite3.Error as exc:
                log.warning("catalogue.write_failed", id=session_id, error=str(exc), step="apply")

    def _apply(self, session_id: str, *, intent_done: tuple[str, str], stamp_if: int | None = None) -> None:
        """The row of ``session_id`` from its files (deleted when its directory is gone), the intent
        dropped; the stamp advanced when it matched the directory just before the change
        (``stamp_if``): nothing the catalogue does not know about happened in between."""
        entry = entry_from_files(self.sessions_root, session_id)
        at = time.time()
        with self._db.transaction() as db:
            if entry is None:
                db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
            else:
                db.execute(f"INSERT OR REPLACE INTO sessions ({COLUMNS}) VALUES ({PLACEHOLDERS})",
                           astuple(entry))
            db.execute("DELETE FROM intents WHERE id = ? AND owner = ?", intent_done)
            if stamp_if is not None and self._db.meta(STAMP_KEY) == str(stamp_if):
                self._db.stamp(self._dir_mtime_ns(), at)

    # ---- a session's life (commits, resume, release) -------------------------------------------------
    def note(self, entry: CatalogueEntry) -> None:
        """Record a live session's row (a commit, a resume, a release); the tier columns
        (retention, pinned, location) of a row already there are kept: they change only with the
        session's tier record (:meth:`note_tier`, or a change of its files). Failures are logged only."""
        try:
            with self._db.transaction() as db:
                db.execute(f"INSERT INTO sessions ({COLUMNS}) VALUES ({PLACEHOLDERS}) ON CONFLICT(id) DO UPDATE "
                           f"SET {_NOTED}", astuple(entry))
        except sqlite3.Error as exc:
            log.warning("catalogue.write_failed", id=entry.id, error=str(exc), step="note")

    def note_tier(self, session_id: str, tier: TierRecord) -> None:
        """Record a session's new retention and pin (its tier record was just written); failures
        are logged only (the next page re-reads the file)."""
        try:
            with self._db.transaction() as db:
                db.execute("UPDATE sessions SET retention_s = ?, pinned = ? WHERE id = ?",
                           (tier.retention_seconds, int(tier.pinned), session_id))
        except sqlite3.Error as exc:
            log.warning("catalogue.write_failed", id=session_id, error=str(exc), step="tier")

    def bytes_by_state(self) -> dict[str, int]:
        """The ``bytes`` of every row summed by state, for the states some row has (resident and
        suspended sessions' files are on this disk, offloaded ones' in the object store). Read
        from the running totals the ``sessions`` table's triggers keep: a few rows, whatever the
        store holds."""
        with self._db.lock:
            rows = self._db.conn.execute("SELECT state, bytes FROM totals WHERE sessions > 0").fetchall()
        return {str(state): int(total) for state, total in rows}

    def forget(self, session_id: str) -> bool:
        """Drop the row of a session whose files are gone; True when there was one."""
        with self._db.transaction() as db:
            return db.execute("DELETE FROM sessions WHERE id = ?", (session_id,)).rowcount > 0

    # ---- reading ---------------------------------------------------------------------------------
    def get(self, session_id: str) -> CatalogueEntry | None:
        """The row of ``session_id`` as recorded (None when not listed)."""
        with self._db.lock:
            row = self._db.conn.execute(f"SELECT {COLUMNS} FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return None if row is None else entry_of_row(row)

    def count(self) -> int:
        with self._db.lock:
            return int(self._db.conn.execute("SELECT count(*) FROM sessions").fetchone()[0])

    def entries(self) -> list[CatalogueEntry]:
        """Every row, by id (a full scan: for tests and tools, not for serving)."""
        with self._db.lock:
            return [entry_of_row(row) for row in self._db.conn.execute(f"SELECT {COLUMNS} FROM sessions ORDER BY id")]

    def page(self, limit: int, after: str | None = None, order: str = "asc") -> CataloguePage:
        """Up to ``limit`` sessions after the cursor ``after`` (any id: it need not be listed, so
        a deleted cursor still pages on) in id order ``asc`` or ``desc``, each re-read from its
        files (a row that changed is written back; one whose directory is gone is ``missing``).
        Costs one ``stat``, one index range scan and ``limit`` manifest reads, whatever the store's
        size; a ``sessions/`` whose mtime is not the stamp is first reconciled (:meth:`reconcile`)."""
        if order not in ("asc", "desc"):
            raise ValueError(f"order {order!r}")
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        where, args = (f"WHERE id {op} ?", [after]) if after is not None else ("", [])
        with self._db.lock:
            moved = self._db.meta(STAMP_KEY) != str(self._dir_mtime_ns())
        if moved:
            self.reconcile()  # sessions/ changed behind the catalogue's back since it was stamped
        with self._db.lock:
            rows = self._db.conn.execute(f"SELECT {COLUMNS} FROM sessions {where} ORDER BY id {direction} LIMIT ?",
                                    (*args, limit + 1)).fetchall()
        listed = [entry_of_row(row) for row in rows[:limit]]
        out: list[CatalogueEntry] = []
        changed: list[tuple[CatalogueEntry, CatalogueEntry]] = []
        for old in listed:
            new = entry_from_files(self.sessions_root, old.id)
            if new is None:
                new = problem_entry(old.id, "missing", _gone(self.sessions_root, old.id))
            else:  # what only the catalogue knows stays (state while live, retention, location)
                new = _keep_runtime(old, new)
            if not new.same_files(old):
                changed.append((old, new))
            out.append(_alive(new))
        if changed:
            self._write_back(changed)
        return CataloguePage(out, len(rows) > limit)

    def _write_back(self, changed: list[tuple[CatalogueEntry, CatalogueEntry]]) -> None:
        """Each ``(old, new)``: the row replaced by ``new`` only while it still is ``old`` (a
        change or a commit that wrote the row meanwhile wins; a row deleted meanwhile stays
        deleted). Failures are logged only: the page already shows the files."""
        try:
            with self._db.transaction() as db:
                for old, new in changed:
                    row = db.execute(f"SELECT {COLUMNS} FROM sessions WHERE id = ?", (old.id,)).fetchone()
                    if row is not None and tuple(row) == astuple(old):
                        db.execute(f"INSERT OR REPLACE INTO sessions ({COLUMNS}) VALUES ({PLACEHOLDERS})",
                                   astuple(new))
        except sqlite3.Error as exc:
            log.warning("catalogue.write_failed", error=str(exc), step="page")


def _gone(sessions_root: Path, session_id: str) -> str:
    return f"{sessions_root / session_id}: the session's directory is gone"


def _keep_runtime(old: CatalogueEntry, new: CatalogueEntry) -> CatalogueEntry:
    """``new`` (from the files) with what only the catalogue knows: whether a process holds the
    session resident (the tier columns and ``offloaded`` come from the files)."""
    if new.state != "suspended":
        return new
    return replace(new, state=old.state if old.state == "resident" else new.state, holder=old.holder)


def _alive(entry: CatalogueEntry) -> CatalogueEntry:
    """``entry`` with a resident state whose holder has died reported as suspended."""
    if entry.state != "resident":
        return entry
    owner = owner_of(entry.holder or "")
    if owner is None or owner.state() != "alive":  # dead, or of another boot
        return replace(entry, state="suspended", holder=None)
    return entry


__all__ = ["RACY_S", "Catalogue", "CataloguePage", "SessionFilesMissingError"]
