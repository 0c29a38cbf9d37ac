"""``SessionStore(root)``: a directory of sessions (create, open, list, delete, fork, prefix match).

Layout (FORMAT.md section 5)::

    <root>/sessions/<id>/manifest.json        the session's manifest (atomic JSON)
    <root>/sessions/<id>/manifest.json.state  its last commit's dynamic fields (one page)
    <root>/sessions/<id>/kv.coli_kv           the latent KV, engine-compatible bytes
    <root>/sessions/<id>/kv.coli_kv.colisum   checksums of the committed records (sidecar)
    <root>/sessions/<id>/kv.coli_kv.lock      the single-writer lock file
    <root>/tmp/                               temp dirs (new sessions, forks, adoptions, trash),
                                              each named after its owning process (sweep.py)

A session directory appears only by an atomic rename of a complete temp dir, so every directory
under ``sessions/`` holds a manifest. Listing reads manifests and ``stat``s files: it never touches
a lock, so it never waits on a writer. Resident sessions are bounded by ``memory_budget`` bytes;
the least recently used ones are suspended (disk only) when a resident session would exceed it.
"""
from __future__ import annotations

import builtins
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kernels.errors import ColiError, CorruptionError, FormatError, LockedError, NotFoundError
from sessionstore.kvfile import (
    REPLACED_PREFIX,
    TMP_DIR_PREFIX,
    TRASH_PREFIX,
    Dims,
    KVWriter,
    Swept,
    WriterLock,
    current_owner,
    fsync_directory,
    open_kv,
    sidecar_path,
    store_entry_name,
    sweep_store_tmp,
)
from sessionstore.log import get_logger
from sessionstore.sessions.commit_state import STATE_SUFFIX
from sessionstore.sessions.manifest import (
    MANIFEST_NAME,
    Manifest,
    ModelRef,
    SamplerSettings,
    read_manifest,
    write_manifest,
)
from sessionstore.sessions.paths import (
    KV_NAME,
    LOCK_NAME,
    SIDECAR_NAME,
    check_component,
    confined,
    resolve_root,
    validate_session_id,
)
from sessionstore.sessions.residency import Residency
from sessionstore.sessions.session import Session
from sessionstore.sessions.snapshot import SessionSnapshot, verify_session_dir
from sessionstore.sessions.turns import common_prefix

SESSIONS_DIR = "sessions"
TMP_DIR = "tmp"
STATE_NAME = MANIFEST_NAME + STATE_SUFFIX  # the last commit's dynamic fields (commit_state)
SNAPSHOT_RETRIES = 5

log = get_logger("store")


@dataclass(frozen=True)
class SessionInfo:
    """One line of ``ls``: read from the manifest and ``stat``, never from a lock."""

    id: str
    tokens: int  # committed records
    pending: list[int]
    kv_dtype: str
    kv_path: str
    bytes: int  # the kv file on disk
    model: str
    fingerprint: str
    updated_at: str

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class SessionStore:
    """A local directory of sessions (the embedded default)."""

    def __init__(self, root: str | os.PathLike[str], *, memory_budget: int | None = None,
                 create: bool = True, sweep: bool | None = None) -> None:
        """Open the store at ``root`` (created with ``create``; else it must hold ``sessions/``).

        A missing ``tmp/`` beside a real ``sessions/`` is recreated (FORMAT.md 5.1.1). ``sweep``
        (default: ``create``, a store opened for writing) removes temporaries no live process
        owns; what it removed is ``self.swept``.
        """
        self.root = resolve_root(root, create=create)
        self.sessions_root = confined(self.root, SESSIONS_DIR)
        self.tmp_root = confined(self.root, TMP_DIR)
        self._open_skeleton(create)
        self.residency: Residency[Session] = Residency(memory_budget)  # resident sessions, LRU budget
        self._models: dict[str, Any] = {}
        self._lock = threading.RLock()
        self.swept: list[Swept] = []
        if create if sweep is None else sweep:
            self.sweep()

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

    def _existing_dir(self, session_id: str) -> Path:
        d = self.session_dir(session_id)
        if not check_component(d, want="dir"):
            raise NotFoundError(f"no session {session_id!r} in {self.sessions_root}")
        return d

    def files_of(self, session_id: str) -> list[Path]:
        """The session's files to copy it whole: manifest, kv, then the sidecar and the commit
        state page when present (bundles fold the state into the manifest they carry); the
        lock file is not data."""
        d = self._existing_dir(session_id)
        files = [d / MANIFEST_NAME, d / KV_NAME]
        for optional in (SIDECAR_NAME, STATE_NAME):
            if check_component(d / optional, want="file"):
                files.append(d / optional)
        for f in files[:2]:
            if not check_component(f, want="file"):
                raise CorruptionError(f"{f}: missing from session {session_id!r}")
        return files

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
        d = self._existing_dir(session_id)
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
        try:
            size = os.lstat(kv).st_size
        except FileNotFoundError:
            size = 0
        return SessionInfo(manifest.id, manifest.committed, list(manifest.pending), manifest.kv_dtype,
                           str(kv), size, manifest.model.name, manifest.model.fingerprint,
                           manifest.updated_at)

    def list(self) -> list[SessionInfo]:
        """Every session (sorted by id); a damaged one is logged and skipped, never waited on."""
        out = []
        for sid in self.ids():
            try:
                out.append(self.info(sid))
            except ColiError as exc:
                log.warning("store.list_skip", id=sid, error=str(exc))
        return out

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

    # ---- sessions --------------------------------------------------------------------------
    def create(self, session_id: str, model_source: str | os.PathLike[str], *, kv_dtype: str = "fp8",
               sampler: SamplerSettings | None = None, **session_options: Any) -> Session:
        """A new, empty session for the model at ``model_source``; returned open (lock held)."""
        validate_session_id(session_id)
        if self.exists(session_id):
            raise FormatError(f"session {session_id!r} already exists in {self.sessions_root}")
        model, ref = self.load_model(model_source)
        return Session.create(self, session_id, model, ref, kv_dtype=kv_dtype,
                              sampler=sampler or SamplerSettings(), **session_options)

    def open(self, session_id: str, model_source: str | os.PathLike[str] | None = None,
             **session_options: Any) -> Session:
        """Resume a session (lock, map, verify). ``model_source`` must match the fingerprint."""
        manifest = self.read_manifest(session_id)
        source = manifest.model.path if model_source is None else model_source
        try:
            model, ref = self.load_model(source)
        except (NotFoundError, FileNotFoundError) as exc:
            raise NotFoundError(
                f"session {session_id!r}: its model {manifest.model.name!r} ({source}) cannot be "
                f"loaded: {exc}; pass --model") from None
        return Session.open(self, session_id, model, ref, **session_options)

    def delete(self, session_id: str) -> None:
        """Remove a session (refused with LockedError while a writer holds it)."""
        d = self._existing_dir(session_id)
        with WriterLock(d / KV_NAME):
            trash = self.trash_dir(session_id)
            os.rename(d, trash)
            fsync_directory(self.sessions_root)
        shutil.rmtree(trash, ignore_errors=True)
        log.info("session.delete", id=session_id)

    # ---- snapshot, fork, adopt -------------------------------------------------------------
    def snapshot(self, session_id: str) -> SessionSnapshot:
        """The last commit of a live or suspended session: manifest + header at that count."""
        return SessionSnapshot.take(session_id, self._existing_dir(session_id), self.read_manifest(session_id))

    def copy_snapshot(self, snap: SessionSnapshot, dst_dir: Path, *, at: int | None = None,
                      new_id: str | None = None) -> tuple[Manifest, str]:
        """Copy ``snap`` (cut to ``at`` records) into ``dst_dir``: :meth:`SessionSnapshot.copy_to`."""
        return snap.copy_to(dst_dir, at=at, new_id=new_id)

    def fork(self, source_id: str, new_id: str, *, at: int | None = None) -> SessionInfo:
        """A new session ``new_id`` holding ``source_id``'s first ``at`` records (default: all)."""
        validate_session_id(new_id)
        if self.exists(new_id):
            raise FormatError(f"session {new_id!r} already exists in {self.sessions_root}")
        for attempt in range(SNAPSHOT_RETRIES):
            snap = self.snapshot(source_id)
            tmp = self.tmp_dir()
            try:
                manifest, method = self.copy_snapshot(snap, tmp, at=at, new_id=new_id)
                if not snap.still_valid():
                    log.info("session.fork_retry", id=source_id, attempt=attempt)
                    continue
                self._install(tmp, new_id)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log.info("session.fork", id=source_id, new=new_id, at=manifest.committed, method=method)
            return self.info(new_id)
        raise LockedError(f"session {source_id!r} kept being truncated while forking; try again")

    def install_empty(self, session_id: str, model_ref: ModelRef, dims: Dims, *, kv_dtype: str = "fp8",
                      sampler: SamplerSettings | None = None) -> Manifest:
        """Install a new, empty session (kv file + manifest, prepared under ``tmp/``, FORMAT.md
        5.1) as ``session_id``; returns its manifest. :meth:`Session.create` opens it."""
        tmp = self.tmp_dir()
        try:
            KVWriter.open(tmp / KV_NAME, dims, kv_dtype=kv_dtype, create=True).close()
            manifest = Manifest(id=session_id, model=model_ref, kv_dtype=kv_dtype,
                                dims={k: int(v) for k, v in asdict(dims).items()},
                                sampler=sampler or SamplerSettings())
            write_manifest(tmp / MANIFEST_NAME, manifest)
            self._install(tmp, session_id)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return manifest

    def _install(self, tmp: Path, session_id: str) -> None:
        """Rename a complete temp dir to ``sessions/<id>`` (refuses an existing session)."""
        fsync_directory(tmp)
        dst = self.session_dir(session_id)
        if check_component(dst, want="dir"):
            raise FormatError(f"session {session_id!r} already exists in {self.sessions_root}")
        try:
            os.rename(tmp, dst)
        except OSError as exc:
            raise FormatError(f"session {session_id!r}: cannot install it ({exc.strerror})") from None
        fsync_directory(self.sessions_root)

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
            self._install(tmp, session_id)
        elif not replace:
            raise FormatError(f"session {session_id!r} already exists (pass replace=True)")
        else:
            with WriterLock(dst / KV_NAME):
                trash = self.trash_dir(session_id, replaced=True)
                os.rename(dst, trash)
                self._install(tmp, session_id)
            shutil.rmtree(trash, ignore_errors=True)
        log.info("session.adopt", id=session_id, replace=replace, tokens=manifest.committed)
        return self.info(session_id)

    # ---- prefix reuse ---------------------------------------------------------------------
    def prefix_match(self, session_id: str, prompt_ids: Sequence[int]) -> int:
        """How many leading records of the history a new prompt can reuse (read-only).

        The longest common prefix of the committed tokens and ``prompt_ids``, at most
        ``len(prompt_ids) - 1`` so that at least one token is fed (its logits pick the next).
        """
        snap = self.snapshot(session_id)
        with open_kv(snap.kv_path) as reader:
            return common_prefix(reader.tokens[:snap.committed], prompt_ids)

    def history(self, session_id: str) -> builtins.list[int]:
        """The conversation's tokens (committed records + pending), read-only, no lock taken."""
        snap = self.snapshot(session_id)
        with open_kv(snap.kv_path) as reader:
            tokens = [int(t) for t in reader.tokens[:snap.committed]]
        return tokens + list(snap.manifest.pending)

    # ---- memory budget (the store's Residency) ----------------------------------------------
    @property
    def memory_budget(self) -> int | None:
        return self.residency.budget

    @memory_budget.setter
    def memory_budget(self, budget: int | None) -> None:
        self.residency.budget = budget

    def resident_sessions(self) -> builtins.list[Session]:
        """Resident sessions, least recently used first."""
        return self.residency.sessions()

    def resident_bytes(self) -> int:
        return self.residency.resident_bytes()

    def enforce_budget(self, keep: Session | None = None) -> builtins.list[str]:
        """Suspend least recently used sessions until the resident ones fit the budget."""
        return self.residency.enforce_budget(keep=keep)


__all__ = ["SessionStore", "SessionInfo", "KV_NAME", "SIDECAR_NAME", "LOCK_NAME", "STATE_NAME", "SESSIONS_DIR",
           "TMP_DIR", "sidecar_path",
           # re-exported for the store's callers (defined in snapshot.py and turns.py)
           "SessionSnapshot", "verify_session_dir", "common_prefix"]
