"""``SessionStore(root)``: the sessions of a store directory (create, open, fork, adopt, prefix
match). It holds its :class:`sessionstore.sessions.directory.StoreDirectory` (``directory``: its
layout, listing, installs and deletes; FORMAT.md section 5), passing on the calls most of its users
make (paths, manifests, a page of the listing, delete), and its :class:`Residency` (``residency``).

Resident sessions are bounded by ``memory_budget`` bytes (``residency.budget``); the least recently
used ones are suspended (disk only) when a resident session would exceed it.
"""
from __future__ import annotations

import builtins
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from kernels.errors import FormatError, LockedError, NotFoundError
from kernels.model.sampling import Sampler
from sessionstore.kvfile import Dims, KVWriter, WriterLock, current_owner, open_kv
from sessionstore.log import get_logger
from sessionstore.sessions.catalogue import Catalogue, CataloguePage
from sessionstore.sessions.catalogue_entry import entry_of_manifest
from sessionstore.sessions.directory import SessionInfo, StoreDirectory
from sessionstore.sessions.disk_usage import session_disk_bytes
from sessionstore.sessions.manifest import (
    MANIFEST_NAME,
    Manifest,
    ModelRef,
    empty_manifest,
    read_manifest,
    write_manifest,
)
from sessionstore.sessions.paths import KV_NAME, check_component, validate_session_id
from sessionstore.sessions.residency_budget import Residency
from sessionstore.sessions.session import Session
from sessionstore.sessions.session_options import DEFAULT_SESSION_OPTIONS, SessionOptions
from sessionstore.sessions.snapshot import SessionSnapshot, verify_session_dir
from sessionstore.sessions.tier_record import refuse_offloaded

SNAPSHOT_RETRIES = 5

log = get_logger("store")


class SessionStore:
    """A local directory of sessions (the embedded default): models, live sessions, forks and
    adoptions; it holds the store's directory tree (``directory``) and the residency budget
    (``residency``), not inheriting either."""

    def __init__(self, root: str | os.PathLike[str], *, memory_budget: int | None = None,
                 create: bool = True, sweep: bool | None = None) -> None:
        """Open the store at ``root`` (its :class:`StoreDirectory`: created with ``create``, swept
        with ``sweep``); at most ``memory_budget`` bytes of sessions stay resident."""
        self.directory = StoreDirectory(root, create=create, sweep=sweep)  # the tree: layout, listing, installs
        self.root, self.sessions_root, self.tmp_root = (self.directory.root, self.directory.sessions_root,
                                                        self.directory.tmp_root)  # fixed paths, read often
        self.residency: Residency[Session] = Residency(memory_budget)  # resident sessions, LRU budget
        self._models: dict[str, Any] = {}
        self._lock = threading.RLock()

    # ---- the directory's calls most users make (the rest: ``directory``) ------------------------
    @property
    def catalogue(self) -> Catalogue:
        """The store's session catalogue (FORMAT.md 5.9), opened on first use."""
        return self.directory.catalogue

    def session_dir(self, session_id: str) -> Path:
        """``<root>/sessions/<id>`` (validated id; the directory may not exist)."""
        return self.directory.session_dir(session_id)

    def kv_path(self, session_id: str) -> Path:
        return self.directory.kv_path(session_id)

    def exists(self, session_id: str) -> bool:
        return self.directory.exists(session_id)

    def read_manifest(self, session_id: str) -> Manifest:
        return self.directory.read_manifest(session_id)

    def info(self, session_id: str) -> SessionInfo:
        return self.directory.info(session_id)

    def page(self, limit: int, after: str | None = None, order: str = "asc") -> CataloguePage:
        """One page of the listing from the catalogue (:meth:`StoreDirectory.page`)."""
        return self.directory.page(limit, after, order)

    def delete(self, session_id: str) -> None:
        """Remove a session (:meth:`StoreDirectory.delete`; refused while a writer holds it)."""
        self.directory.delete(session_id)

    # ---- models ----------------------------------------------------------------------------
    def load_model(self, source: str | os.PathLike[str]) -> tuple[Any, ModelRef]:
        """Load (once per fingerprint) the model at ``source`` ("tiny" or a checkpoint dir)."""
        from kernels.model import load_model
        from sessionstore.sessions.fingerprint import TINY_NAME, model_fingerprint

        src = os.fspath(source)
        fingerprint = model_fingerprint(src)
        if src == TINY_NAME:
            ref = ModelRef(TINY_NAME, TINY_NAME, fingerprint)
        else:
            path = Path(src).resolve()
            ref = ModelRef(path.name, str(path), fingerprint)
        with self._lock:
            model = self._models.get(fingerprint)
            if model is None:
                model = self._models[fingerprint] = load_model(src)
        return model, ref

    def adopt_model(self, source: str | os.PathLike[str], model: Any) -> None:
        """Sessions of the model at ``source`` use ``model`` from now on (a wrapper of the loaded
        one, e.g. the service's, whose forwards run on its engine thread)."""
        from sessionstore.sessions.fingerprint import model_fingerprint

        with self._lock:
            self._models[model_fingerprint(os.fspath(source))] = model

    # ---- sessions --------------------------------------------------------------------------
    def create(self, session_id: str, model_source: str | os.PathLike[str], *, kv_dtype: str = "fp8",
               sampler: Sampler | None = None, options: SessionOptions = DEFAULT_SESSION_OPTIONS) -> Session:
        """A new, empty session for the model at ``model_source``; returned open (lock held).
        Refused when ``session_id`` is taken (:meth:`install_empty`)."""
        validate_session_id(session_id)
        model, ref = self.load_model(model_source)
        return Session.create(self, session_id, model, ref, kv_dtype=kv_dtype,
                              sampler=sampler or Sampler(), options=options)

    def open(self, session_id: str, model_source: str | os.PathLike[str] | None = None,
             options: SessionOptions = DEFAULT_SESSION_OPTIONS, *, beside: bool = False) -> Session:
        """Resume a session (lock, map, verify). ``model_source`` must match the fingerprint;
        ``beside``: its checksum pass beside the caller's turn (``Session.open``)."""
        manifest = self.read_manifest(session_id)
        source = manifest.model.path if model_source is None else model_source
        try:
            model, ref = self.load_model(source)
        except (NotFoundError, FileNotFoundError) as exc:
            raise NotFoundError(
                f"session {session_id!r}: its model {manifest.model.name!r} ({source}) cannot be "
                f"loaded: {exc}; pass --model") from None
        return Session.open(self, session_id, model, ref, options, manifest, beside=beside)

    # ---- snapshot, fork, adopt -------------------------------------------------------------
    def snapshot(self, session_id: str) -> SessionSnapshot:
        """The last commit of a live or suspended session: manifest + header at that count
        (SessionOffloadedError for an offloaded one, FORMAT.md 5.10)."""
        d = self.directory.existing_dir(session_id)
        refuse_offloaded(d, session_id)
        return SessionSnapshot.take(session_id, d, self.read_manifest(session_id))

    def fork(self, source_id: str, new_id: str, *, at: int | None = None) -> SessionInfo:
        """A new session ``new_id`` holding ``source_id``'s first ``at`` records (default: all)."""
        validate_session_id(new_id)
        if self.exists(new_id):
            raise FormatError(f"session {new_id!r} already exists in {self.sessions_root}")
        for attempt in range(SNAPSHOT_RETRIES):
            snap = self.snapshot(source_id)
            tmp = self.directory.tmp_dir()
            try:
                manifest, method = snap.copy_to(tmp, at=at, new_id=new_id)
                if not snap.still_valid():
                    log.info("session.fork_retry", id=source_id, attempt=attempt)
                    continue
                self.directory.install_dir(tmp, new_id)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log.info("session.fork", id=source_id, new=new_id, at=manifest.committed, method=method)
            return self.info(new_id)
        raise LockedError(f"session {source_id!r} kept being truncated while forking; try again")

    def install_empty(self, session_id: str, model_ref: ModelRef, dims: Dims, *, kv_dtype: str = "fp8",
                      sampler: Sampler | None = None, manifest: Manifest | None = None) -> Manifest:
        """Install a new, empty session (kv file + manifest, prepared under ``tmp/``, FORMAT.md
        5.1) as ``session_id``; returns its manifest (``manifest`` when given: the one
        :func:`empty_manifest` made for it beforehand). :meth:`Session.create` opens it. Refused
        (:meth:`refuse_taken`). File work and the catalogue only (a server runs it on an I/O
        thread: :class:`IoRunner`, or :class:`IoStarter` while the first turn runs)."""
        self.refuse_taken(session_id)
        tmp = self.directory.tmp_dir()
        try:
            KVWriter.open(tmp / KV_NAME, dims, kv_dtype=kv_dtype, create=True).close()
            if manifest is None:
                manifest = empty_manifest(session_id, model_ref, dims, kv_dtype, sampler or Sampler())
            write_manifest(tmp / MANIFEST_NAME, manifest)
            self.directory.install_dir(tmp, session_id)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return manifest

    def refuse_taken(self, session_id: str) -> None:
        """Refuse a new session's id (FormatError) when ``session_id`` exists, and when the
        catalogue lists it though its files are gone (SessionFilesMissingError: reported, never
        silently made anew)."""
        if self.exists(session_id):
            raise FormatError(f"session {session_id!r} already exists in {self.sessions_root}")
        self.directory.refuse_listed(session_id)

    def adopt_dir(self, tmp_dir: str | os.PathLike[str], session_id: str, *,
                  replace: bool = False) -> SessionInfo:
        """Install a complete session directory prepared under ``<root>/tmp/`` as ``session_id``.

        The directory is verified first (manifest, kv dims/version/length, sidecar checksums);
        the manifest id is rewritten if it differs. With ``replace`` an existing session is
        swapped out (refused with LockedError while a writer holds it).
        """
        tmp = Path(tmp_dir).resolve()
        if tmp.parent != self.tmp_root:
            raise FormatError(f"{tmp}: adopt_dir takes a directory directly under {self.tmp_root}")
        validate_session_id(session_id)
        verify_session_dir(tmp)
        manifest = read_manifest(tmp / MANIFEST_NAME)
        if manifest.id != session_id:
            manifest.id = session_id
            write_manifest(tmp / MANIFEST_NAME, manifest)
        dst = self.session_dir(session_id)
        if not check_component(dst, want="dir"):
            self.directory.install_dir(tmp, session_id)
        elif not replace:
            raise FormatError(f"session {session_id!r} already exists (pass replace=True)")
        else:
            with WriterLock(dst / KV_NAME), self.catalogue.changing(session_id):
                trash = self.directory.trash_dir(session_id, replaced=True)
                os.rename(dst, trash)
                self.directory.install_dir(tmp, session_id)
            shutil.rmtree(trash, ignore_errors=True)
        log.info("session.adopt", id=session_id, replace=replace, tokens=manifest.committed)
        return self.info(session_id)

    def note_session(self, manifest: Manifest, *, resident: bool) -> None:
        """Record a live session's last commit in the catalogue (a resume, a commit, a release):
        its manifest's fields and its files' size on disk; ``resident``: held by this process."""
        try:
            os.lstat(self.kv_path(manifest.id))
        except OSError:
            return  # its files went away: the catalogue reports it when listed
        size = session_disk_bytes(self.session_dir(manifest.id))
        self.catalogue.note(entry_of_manifest(manifest, size, state="resident" if resident else "suspended",
                                              holder=current_owner().token if resident else None))

    def history(self, session_id: str) -> builtins.list[int]:
        """The conversation's tokens (committed records + pending), read-only, no lock taken."""
        snap = self.snapshot(session_id)
        with open_kv(snap.kv_path) as reader:
            tokens = [int(t) for t in reader.tokens[:snap.committed]]
        return tokens + list(snap.manifest.pending)


__all__ = ["SessionStore", "SNAPSHOT_RETRIES"]
