"""Trade sessions with the colibri engine's slot files.

The engine keeps slot 0 at ``<model_dir>/.coli_kv`` and slot i >= 1 at ``<model_dir>/.coli_kv.<i>``.
``import_slot`` turns a slot into a session (its committed records only; the engine stores no
pending token, so the session continues from the recomputed last logits). ``export_slot`` writes
a session's committed records as a slot file: exactly the engine's bytes (header with nrec =
committed, the records, nothing after), committed atomically (temp -> fsync -> rename -> fsync
dir). A sidecar left beside the slot by an earlier tool run is removed first (it would vouch for
other bytes); the engine never reads one.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from pathlib import Path

from kernels.errors import CorruptionError, FormatError, ModelMismatchError, NotFoundError
from sessionstore.kvfile import (
    Dims,
    copy_committed,
    copy_sidecar_prefix,
    fsync_directory,
    open_kv,
    require_vouched,
    sidecar_path,
)
from sessionstore.log import get_logger
from sessionstore.sessions.directory import SessionInfo
from sessionstore.sessions.manifest import MANIFEST_NAME, Manifest, write_manifest
from sessionstore.sessions.paths import KV_NAME, validate_session_id
from sessionstore.sessions.snapshot import SessionSnapshot
from sessionstore.sessions.store import SNAPSHOT_RETRIES, SessionStore

SLOT_NAME = ".coli_kv"
MAX_SLOT = 9999

log = get_logger("slots")


def slot_path(model_dir: str | os.PathLike[str], slot: int = 0) -> Path:
    """``<model_dir>/.coli_kv`` for slot 0, ``<model_dir>/.coli_kv.<i>`` for slot i >= 1."""
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot <= MAX_SLOT:
        raise FormatError(f"slot must be an integer in [0, {MAX_SLOT}], found {slot!r}")
    name = SLOT_NAME if slot == 0 else f"{SLOT_NAME}.{slot}"
    return Path(model_dir) / name


def import_slot(store: SessionStore, model_dir: str | os.PathLike[str], *, slot: int = 0,
                session_id: str | None = None, replace: bool = False) -> SessionInfo:
    """A new session from the engine's slot file (v1 -> f32, v2 -> fp8, v3 -> its 4-bit codec)."""
    session_id = validate_session_id(session_id or f"slot-{slot}")
    model, ref = store.load_model(model_dir)
    src = slot_path(model_dir, slot)
    dims = Dims(*model.dims_for_file())
    with open_kv(src, expect=dims) as reader:
        header = reader.header.with_nrec(reader.nrec)
        warnings = list(reader.warnings)
    kv_dtype = header.kv_dtype
    tmp = store.directory.tmp_dir()
    try:
        method = copy_committed(src, tmp / KV_NAME, header)
        copy_sidecar_prefix(src, tmp / KV_NAME, header)
        manifest = Manifest(id=session_id, model=ref, kv_dtype=kv_dtype,
                            dims={k: int(v) for k, v in asdict(dims).items()},
                            committed=header.nrec, origin=f"import-slot {src}")
        write_manifest(tmp / MANIFEST_NAME, manifest)
        info = store.adopt_dir(tmp, session_id, replace=replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("slot.import", path=str(src), id=session_id, records=header.nrec, kv_dtype=kv_dtype,
             method=method, warnings=warnings)
    return info


def export_slot(store: SessionStore, session_id: str, model_dir: str | os.PathLike[str], *,
                slot: int = 0, force: bool = False) -> Path:
    """Write the session's committed records as the engine's slot file; returns its path.

    The model directory must hold the session's model (same fingerprint) unless ``force``; the
    dims always have to match (the engine checks them when it loads the slot).
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise NotFoundError(f"{model_dir}: not a model directory (no config.json)")
    manifest = store.read_manifest(session_id)
    if not force:
        from sessionstore.sessions.fingerprint import model_fingerprint

        found = model_fingerprint(model_dir)
        if found != manifest.model.fingerprint:
            raise ModelMismatchError(
                f"{model_dir} holds model {found}, session {session_id!r} belongs to "
                f"{manifest.model.name!r} ({manifest.model.fingerprint}); pass --force to export anyway")
    from kernels.model.config import load_config

    cfg = load_config(model_dir)
    model_dims = cfg.file_dims  # a DSA model's slot carries its Ic rows
    if Dims(**manifest.dims).as_tuple() != model_dims:
        raise ModelMismatchError(f"session dims {Dims(**manifest.dims).as_tuple()} differ from "
                                 f"{model_dir}'s {model_dims}")
    dst = slot_path(model_dir, slot)
    if dst.is_symlink() or (dst.exists() and not dst.is_file()):
        raise FormatError(f"{dst}: exists and is not a regular file; refusing to replace it")
    for _ in range(SNAPSHOT_RETRIES):
        snap = store.snapshot(session_id)
        tmp = dst.with_name(f"{dst.name}.export-{os.getpid()}-{os.urandom(4).hex()}.tmp")
        try:
            copy_committed(snap.kv_path, tmp, snap.header)
            if not snap.still_valid():
                continue
            _check_copy(tmp, snap)
            stale = Path(sidecar_path(dst))
            if stale.exists() or stale.is_symlink():
                stale.unlink()
                fsync_directory(model_dir)
            os.replace(tmp, dst)
            fsync_directory(model_dir)
        finally:
            if tmp.exists():
                tmp.unlink()
        log.info("slot.export", id=session_id, path=str(dst), records=snap.committed)
        return dst
    raise FormatError(f"session {session_id!r} kept being truncated while exporting; try again")


def _check_copy(copy: Path, snap: SessionSnapshot) -> None:
    """The slot's bytes against the session's sidecar: every committed record it vouches for
    (all of them, for a session of ours) matches, or the export is refused."""
    reader = open_kv(copy, expect=snap.header.dims)
    try:
        if reader.nrec != snap.committed:
            raise CorruptionError(f"{copy}: copied {reader.nrec} records, the session commits "
                                  f"{snap.committed}")
        require_vouched(reader, snap.committed, vouched_by=snap.kv_path)
    except CorruptionError as exc:
        raise CorruptionError(f"session {snap.id!r}: export-slot refused: {exc}") from None
    finally:
        reader.close(defer_unmap=True)


__all__ = ["slot_path", "import_slot", "export_slot", "SLOT_NAME"]
