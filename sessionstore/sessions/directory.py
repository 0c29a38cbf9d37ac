"""The store's directories on disk (FORMAT.md section 5): layout, listing, and the atomic
installation and removal of whole session directories.

Layout::

    <root>/sessions/<id>/manifest.json        the session's manifest (atomic JSON)
    <root>/sessions/<id>/manifest.json.state  its last commits' dynamic fields (two page slots)
    <root>/sessions/<id>/kv.coli_kv           the latent KV, engine-compatible bytes
    <root>/sessions/<id>/kv.coli_kv.colisum   checksums of the committed records (sidecar)
    <root>/sessions/<id>/kv.coli_kv.lock      the single-writer lock file
    <root>/tmp/                               temp dirs (new sessions, forks, adoptions, trash),
                                              each named after its owning process (sweep.py)
    <root>/catalogue.sqlite3                  the session catalogue, a cache of the files (catalogue.py)

A session directory appears only by an atomic rename of a complete temp dir, so every directory
under ``sessions/`` holds a manifest. Listing reads manifests and ``stat``s files: it never touches
a lock, so it never waits on a writer. A page of the listing comes from the catalogue
(:mod:`sessionstore.sessions.catalogue`), which every install and delete keeps up to date.
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.errors import ColiError, FormatError, LimitError, NotFoundError
from sessionstore.kvfile import (
    REPLACED_PREFIX,
    TMP_DIR_PREFIX,
    TRASH_PREFIX,
    Swept,
    WriterLock,
    current_owner,
    fsync_directory,
    store_entry_name,
    sweep_store_tmp,
)
from sessionstore.log import get_logger
from sessionstore.sessions.catalogue import Catalogue, CataloguePage, SessionFilesMissingError
from sessionstore.sessions.commit_state_page import STATE_SUFFIX
from sessionstore.sessions.disk_usage import session_disk_bytes
from sessionstore.sessions.manifest import MANIFEST_NAME, Manifest, read_manifest
from sessionstore.sessions.paths import (
    KV_NAME,
    check_component,
    confined,
    resolve_root,
    validate_session_id,
)

SESSIONS_DIR = "sessions"
TMP_DIR = "tmp"
STATE_NAME = MANIFEST_NAME + STATE_SUFFIX  # the last commit's dynamic fields (commit_state_page)
MAX_PAGE = 1000  # the most sessions one page of the listing may hold
ORDERS = ("asc", "desc")

log = get_logger("store")


@dataclass(frozen=True)
class SessionInfo:
    """One line of ``ls``: read from the manifest and ``stat``, never from a lock."""

    id: str
    tokens: int  # committed records
    pending: list[int]
    kv_dtype: str
    kv_path: str
    bytes: int  # the session's files on disk (disk_usage.session_disk_bytes)
    model: str
    fingerprint: str
    updated_at: str

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class StoreDirectory:
    """A store's directory tree: ``sessions/`` and ``tmp/`` under ``root``, their paths, the
    listing, and whole session directories installed by rename or moved out to be deleted."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True, sweep: bool | None = None) -> None:
        """Open the tree at ``root`` (created with ``create``; else it must hold ``sessions/``).

        A missing ``tmp/`` beside a real ``sessions/`` is recreated (FORMAT.md 5.1.1). ``sweep``
        (default: ``create``, a store opened for writing) removes temporaries no live process
        owns; what it removed is ``self.swept``.
        """
        self.root = resolve_root(root, create=create)
        self.sessions_root = confined(self.root, SESSIONS_DIR)
        self.tmp_root = confined(self.root, TMP_DIR)
        self._open_skeleton(create)
        self.swept: list[Swept] = []
        if create if sweep is None else sweep:
            self.sweep()

    @functools.cached_property
    def catalogue(self) -> Catalogue:
        """The store's session catalogue (FORMAT.md 5.9), opened and brought up to date on first
        use: a command that reads one session by id never opens it."""
        return Catalogue(self.root, self.sessions_root)

    def _open_skeleton(self, create: bool) -> None:
        """Check (or make) ``sessions/`` and ``tmp/``; never removes or replaces either."""
        if not check_component(self.sessions_root, want="dir"):
            if not create:
                raise NotFoundError(f"{self.root}: not a session store (no {SESSIONS_DIR}/)")
            self.sessions_root.mkdir(exist_ok=True)
        if check_component(self.tmp_root, want="dir"):
            return
        try:
            self.tmp_root.mkdir(exist_ok=True)
        except OSError as exc:  # a read-only store still lists; tmp_dir() says why it cannot write
            log.warning("store.skeleton_missing", path=str(self.tmp_root), error=exc.strerror)
            return
        log.info("store.skeleton_repaired", path=str(self.tmp_root),
                 reason="missing beside sessions/ (recreated, empty)")

    def sweep(self) -> list[Swept]:
        """Remove temporaries under ``tmp/`` that no live process owns (each one logged as
        ``temp.swept`` with its path and bytes); returns them and adds them to ``self.swept``."""
        swept = sweep_store_tmp(self.tmp_root, self.sessions_root)
        self.swept.extend(swept)
        if swept:
            log.info("store.sweep", root=str(self.root), entries=len(swept),
                     bytes=sum(s.bytes for s in swept))
        return swept

    # ---- paths (public API for bundles) ------------------------------------------------------
    def session_dir(self, session_id: str) -> Path:
        """``<root>/sessions/<id>`` (validated id; the directory may not exist)."""
        return confined(self.root, SESSIONS_DIR, validate_session_id(session_id))

    def kv_path(self, session_id: str) -> Path:
        return self.session_dir(session_id) / KV_NAME

    def exists(self, session_id: str) -> bool:
        return check_component(self.session_dir(session_id), want="dir")

    def existing_dir(self, session_id: str) -> Path:
        """``sessions/<id>``, which must exist (else NotFoundError; SessionFilesMissingError when
        the catalogue lists it: its files are gone)."""
        d = self.session_dir(session_id)
        if not check_component(d, want="dir"):
            self.refuse_listed(session_id)
            raise NotFoundError(f"no session {session_id!r} in {self.sessions_root}")
        return d

    def refuse_listed(self, session_id: str) -> None:
        """Raise SessionFilesMissingError when the catalogue lists ``session_id`` (whose directory
        is absent): such a session is reported, never served, and its id is not reused until it
        is deleted (``coli-kv rm``)."""
        if self.catalogue.get(session_id) is not None:
            raise SessionFilesMissingError(
                f"session {session_id!r} is in the store's catalogue but its files are gone "
                f"({self.sessions_root / session_id} is missing): it cannot be served; delete it "
                "(coli-kv rm) to drop it from the catalogue")

    def tmp_dir(self) -> Path:
        """A fresh, empty directory ``<root>/tmp/t-<owner>-...`` (same filesystem: renames are
        atomic); its name records this process, so a sweep never takes it while it lives."""
        if not check_component(self.tmp_root, want="dir"):
            raise NotFoundError(f"{self.tmp_root}: missing and cannot be recreated; the store "
                                "cannot be written")
        prefix = f"{TMP_DIR_PREFIX}{current_owner().token}-"
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.tmp_root))

    def trash_dir(self, session_id: str, *, replaced: bool = False) -> Path:
        """A fresh name under ``tmp/`` (owned by this process) to move a session out to: a
        deleted one (swept as debris if this process dies), or one a replace swaps out (kept
        by the sweep while ``sessions/<id>`` is absent)."""
        prefix = REPLACED_PREFIX if replaced else TRASH_PREFIX
        return self.tmp_root / store_entry_name(prefix, session_id)

    def read_manifest(self, session_id: str) -> Manifest:
        d = self.existing_dir(session_id)
        manifest = read_manifest(d / MANIFEST_NAME)
        if manifest.id != session_id:
            raise FormatError(f"{d / MANIFEST_NAME}: manifest id {manifest.id!r}, expected {session_id!r}")
        return manifest

    # ---- listing -------------------------------------------------------------------------------
    def ids(self) -> list[str]:
        out = []
        for entry in sorted(os.listdir(self.sessions_root)):
            try:
                validate_session_id(entry)
            except ColiError:
                continue  # not ours (a stray name): never listed, never touched
            out.append(entry)
        return out

    def info(self, session_id: str) -> SessionInfo:
        manifest = self.read_manifest(session_id)
        kv = self.kv_path(session_id)
        size = session_disk_bytes(self.session_dir(session_id))
        return SessionInfo(manifest.id, manifest.committed, list(manifest.pending), manifest.kv_dtype,
                           str(kv), size, manifest.model.name, manifest.model.fingerprint,
                           manifest.updated_at)

    def page(self, limit: int, after: str | None = None, order: str = "asc") -> CataloguePage:
        """One page of the listing from the catalogue, in id order (``asc`` or ``desc``), after
        the cursor ``after`` (a valid id; it need not be a session now), each entry re-read from
        its files. Bad arguments raise LimitError / FormatError naming the parameter."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
            raise LimitError(f"limit must be an integer from 1 to {MAX_PAGE}, found {limit!r}")
        if order not in ORDERS:
            raise FormatError(f"order must be one of {', '.join(ORDERS)}, found {order!r}")
        if after is not None:
            validate_session_id(after)
        return self.catalogue.page(limit, after, order)

    def list(self) -> list[SessionInfo]:
        """Every session (sorted by id); a damaged one is logged and skipped, never waited on."""
        out = []
        for sid in self.ids():
            try:
                out.append(self.info(sid))
            except ColiError as exc:
                log.warning("store.list_skip", id=sid, error=str(exc))
        return out

    # ---- installation and removal ---------------------------------------------------------
    def install_dir(self, tmp: Path, session_id: str) -> None:
        """Rename a complete temp dir to ``sessions/<id>`` (refuses an existing session); then
        fsync ``sessions/`` and the temp dir's parent: a rename across two directories is
        durable only once both are (FORMAT.md 5.1; else a crash may keep the old name, or lose
        the new one, and the sweep would remove the session's files under ``tmp/``)."""
        fsync_directory(tmp)
        dst = self.session_dir(session_id)
        if check_component(dst, want="dir"):
            raise FormatError(f"session {session_id!r} already exists in {self.sessions_root}")
        with self.catalogue.changing(session_id):
            try:
                os.rename(tmp, dst)
            except OSError as exc:
                raise FormatError(f"session {session_id!r}: cannot install it ({exc.strerror})") from None
            fsync_directory(self.sessions_root)
            fsync_directory(tmp.parent)

    def delete(self, session_id: str) -> None:
        """Remove a session (refused with LockedError while a writer holds it); a session the
        catalogue lists whose files are gone is dropped from the catalogue."""
        d = self.session_dir(session_id)
        if not check_component(d, want="dir") and self.catalogue.forget(session_id):
            log.warning("session.delete_missing", id=session_id, reason="its files were already gone")
            return
        d = self.existing_dir(session_id)
        with WriterLock(d / KV_NAME), self.catalogue.changing(session_id):
            trash = self.trash_dir(session_id)
            os.rename(d, trash)
            fsync_directory(self.sessions_root)
        shutil.rmtree(trash, ignore_errors=True)
        log.info("session.delete", id=session_id)


__all__ = ["MAX_PAGE", "ORDERS", "SESSIONS_DIR", "STATE_NAME", "TMP_DIR", "SessionInfo", "StoreDirectory"]
