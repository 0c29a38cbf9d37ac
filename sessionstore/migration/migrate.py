"""Import a bundle as a session (the store side of migration; the export side is
:mod:`sessionstore.migration.exporting`).

Import reads the manifest frame, validates it against the session manifest schema, the layout
limits, the model (``model=``) and the store (id taken without ``replace``), checks the free
space, streams every file into a fresh directory under ``<root>/tmp/`` (payloads read into one
reused buffer, written straight to the file with the disk's write-back started as they land),
verifies every chunk, file digest and the trailer, the kv header and the sidecar, fsyncs, and
installs the directory with one rename (``SessionStore.adopt_dir``). On ANY failure the temp
directory is removed: the store is left exactly as it was. ``receive_bundle`` is everything up to
the install (a server receives an upload without holding the session), ``ReceivedBundle.install``
the rename.
"""
from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kernels.errors import ColiError, CorruptionError, FormatError, LimitError, ModelMismatchError
from kernels.rows import KV_FORMAT_OF_DTYPE
from sessionstore.kvfile import (
    ENTRY_SIZE,
    HEADER_SIZE,
    SIDECAR_HEADER_SIZE,
    Dims,
    Durability,
    load_sidecar,
    open_kv,
    parse_header,
    record_bytes,
    static_hash,
    validate_dims,
    write_sidecar_for,
)
from sessionstore.log import get_logger
from sessionstore.migration import bundle as B
from sessionstore.migration.bundle_format import ALLOWED_FILES, BundleManifest, BundleStats, parse_json
from sessionstore.migration.bundle_format import MAX_RESPONSES_BYTES as BUNDLE_MAX_RESPONSES_BYTES
from sessionstore.migration.bundle_io import SYNC_AHEAD_BYTES, WritebackFile
from sessionstore.migration.exporting import MigrateResult, progress_bar
from sessionstore.sessions import (
    CONVERSATION_NAME,
    KV_NAME,
    MANIFEST_NAME,
    MAX_RESPONSES_BYTES,
    RESPONSES_NAME,
    SIDECAR_NAME,
    ModelRef,
    SessionStore,
    manifest_from_json,
    read_manifest,
    read_record,
    read_response_list,
    write_manifest,
)

log = get_logger("migrate")
_progress = progress_bar  # the import side's progress bar (the same as export's)

FREE_SPACE_MARGIN = 64 << 20  # left free on the store's filesystem after an import
assert (MANIFEST_NAME, KV_NAME, SIDECAR_NAME, CONVERSATION_NAME, RESPONSES_NAME) == ALLOWED_FILES
assert MAX_RESPONSES_BYTES == BUNDLE_MAX_RESPONSES_BYTES


def _check_frame(bm: BundleManifest, where: str) -> tuple[Any, Dims, int]:
    """The manifest frame must describe one consistent session; returns (manifest, dims, rec)."""
    manifest = manifest_from_json(bm.session, f"{where}: session manifest")
    if manifest.id != bm.session_id:
        raise FormatError(f"{where}: session manifest id {manifest.id!r} differs from the "
                          f"bundle's {bm.session_id!r}")
    kv = bm.kv
    expected_keys = {"version", "dtype", "nrec", "record_bytes", "tag", "dims"}
    if set(kv) != expected_keys or any(type(kv[k]) is not int
                                       for k in ("version", "nrec", "record_bytes", "tag")):
        raise FormatError(f"{where}: 'kv' must hold exactly {sorted(expected_keys)} "
                          "(version, nrec, record_bytes and tag as integers)")
    if kv["dtype"] != manifest.kv_dtype or (kv["version"], kv["tag"]) != KV_FORMAT_OF_DTYPE[manifest.kv_dtype]:
        raise FormatError(f"{where}: kv v{kv['version']!r} {kv['dtype']!r} does not match the "
                          f"session's {manifest.kv_dtype}")
    if kv["dims"] != manifest.dims or kv["nrec"] != manifest.committed:
        raise FormatError(f"{where}: kv dims/nrec {kv['dims']}/{kv['nrec']!r} differ from the "
                          f"session manifest's {manifest.dims}/{manifest.committed}")
    dims = Dims(**manifest.dims)
    validate_dims(dims, where)
    rec = record_bytes(manifest.kv_version, dims, manifest.kv_tag)
    if kv["record_bytes"] != rec:
        raise FormatError(f"{where}: kv record_bytes {kv['record_bytes']!r}, expected {rec}")
    kv_file = bm.file(KV_NAME)
    assert kv_file is not None  # REQUIRED_FILES
    expect = HEADER_SIZE + manifest.committed * rec
    if kv_file.size != expect:
        raise FormatError(f"{where}: {KV_NAME} declared {kv_file.size} bytes, expected "
                          f"{expect} (40 + {manifest.committed} records x {rec})")
    side = bm.file(SIDECAR_NAME)
    if side is not None:
        count, extra = divmod(side.size - SIDECAR_HEADER_SIZE, ENTRY_SIZE)
        if side.size < SIDECAR_HEADER_SIZE or extra or count > manifest.committed:
            raise FormatError(f"{where}: {SIDECAR_NAME} declared {side.size} bytes, expected "
                              f"{SIDECAR_HEADER_SIZE} + 8 x (0..{manifest.committed})")
    return manifest, dims, rec


def check_model(manifest: Any, model: str | os.PathLike[str] | None) -> None:
    """Refuse a bundle whose model fingerprint is not the named local model's."""
    if model is None:
        return
    from sessionstore.sessions import model_fingerprint

    local = model_fingerprint(model)
    if local != manifest.model.fingerprint:
        raise ModelMismatchError(
            f"session {manifest.id!r} belongs to model {manifest.model.name!r} "
            f"({manifest.model.fingerprint}), not to the local model {os.fspath(model)!r} ({local})")


def _check_space(store: SessionStore, needed: int) -> None:
    st = os.statvfs(store.tmp_root)
    free = st.f_bavail * st.f_frsize
    if needed + FREE_SPACE_MARGIN > free:
        raise LimitError(f"{store.root}: the bundle needs {needed} bytes, only {free} are free "
                         f"(keeping {FREE_SPACE_MARGIN} spare)")


def _receive(reader: B.BundleReader, tmp: Path, bar: Any) -> None:
    """Every file of the bundle into ``tmp`` (created exclusively, no symlink followed), each
    chunk verified before it is written; then one durability barrier per file."""
    outs: list[WritebackFile] = []
    clock = time.perf_counter
    read_s = write_s = 0.0
    cpu = time.thread_time()
    try:
        for entry in reader.manifest.files:
            out = WritebackFile.create(tmp / entry.name, sync_ahead=SYNC_AHEAD_BYTES)
            outs.append(out)
            t = clock()
            for raw in reader.iter_file(entry.name, copy=False):
                t1 = clock()
                out.write(raw)
                if bar is not None:
                    bar.update(len(raw))
                t2 = clock()
                read_s, write_s, t = read_s + t1 - t, write_s + t2 - t1, t2
        t = clock()
        for out in outs:
            out.settle()  # a background fdatasync's failure fails the import
        _fsync_all([out.fileno() for out in outs])
        log.debug("bundle.receive_spans", read_s=round(read_s, 4), write_s=round(write_s, 4),
                  fsync_s=round(clock() - t, 4), cpu_s=round(time.thread_time() - cpu, 4))
    finally:
        for out in outs:
            out.close()


def _fsync_all(fds: Sequence[int]) -> None:
    io = Durability()
    try:
        io.fsync_all(fds)
    finally:
        io.release()


@dataclass
class ReceivedBundle:
    """A bundle received and verified whole into a temp directory under ``<root>/tmp/``, not yet
    installed: :meth:`install` renames it into place, :meth:`discard` removes it. The receiving
    needs no lock on the session; the install is one rename (what a server runs under the
    session's claim)."""

    store: SessionStore
    tmp: Path
    session_id: str
    source_name: str
    stats: BundleStats
    start: float

    def install(self, session_id: str | None = None, *, replace: bool = False) -> MigrateResult:
        """Install as ``session_id`` (default: the bundle's id); the temp dir is gone either way."""
        sid = self.session_id if session_id is None else session_id
        try:
            if self.store.exists(sid) and not replace:
                raise FormatError(f"session {sid!r} already exists in {self.store.root}; give --replace "
                                  "to swap it for the bundle's")
            info = self.store.adopt_dir(self.tmp, sid, replace=replace)
        except BaseException as exc:
            self.discard(exc)
            raise
        st = self.stats
        log.info("bundle.import", id=sid, tokens=info.tokens, raw_bytes=st.raw_bytes, replace=replace)
        return MigrateResult(sid, info.tokens, info.kv_dtype, st.raw_bytes, st.stored_bytes, st.chunks,
                             st.zstd_chunks, time.perf_counter() - self.start)

    def discard(self, why: BaseException | None = None) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        if why is not None:
            _log_failed(self.session_id, self.source_name, why)


def _log_failed(session_id: str, source_name: str, exc: BaseException) -> None:
    log.info("bundle.import_failed", id=session_id, source=source_name,
             error=str(exc) if isinstance(exc, ColiError) else repr(exc))


def receive_bundle(store: SessionStore, source: BinaryIO, *, source_name: str = "<bundle>",
                   replace: bool = False, model: str | os.PathLike[str] | None = None,
                   as_id: str | None = None, progress: bool = False) -> ReceivedBundle:
    """Read one bundle into a fresh temp directory, every chunk verified as it lands, then the
    file digests, the trailer, the kv header, the sidecar and the conversation; fsynced. Nothing
    is installed; on ANY failure the temp directory is removed."""
    start = time.perf_counter()
    reader = B.BundleReader(source, source_name)
    bm = reader.manifest
    manifest, dims, rec = _check_frame(bm, source_name)
    check_model(manifest, model)
    session_id = bm.session_id if as_id is None else as_id
    if store.exists(session_id) and not replace:
        raise FormatError(f"session {session_id!r} already exists in {store.root}; give --replace "
                          "to swap it for the bundle's")
    _check_space(store, bm.total_bytes)
    log.info("bundle.import_start", id=session_id, source=source_name, tokens=manifest.committed,
             bytes=bm.total_bytes)
    tmp = store.directory.tmp_dir()
    bar = None
    try:
        bar = _progress(bm.total_bytes, f"import {session_id}", progress)
        _receive(reader, tmp, bar)
        stats = reader.finish()
        _verify_received(tmp, bm, manifest, dims)
        if model is not None:
            _point_at_local_model(tmp, model)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _log_failed(session_id, source_name, exc)
        raise
    finally:
        if bar is not None:
            bar.close()
    return ReceivedBundle(store, tmp, session_id, source_name, stats, start)


def import_bundle(store: SessionStore, source: BinaryIO, *, source_name: str = "<bundle>",
                  replace: bool = False, model: str | os.PathLike[str] | None = None,
                  as_id: str | None = None, progress: bool = False) -> MigrateResult:
    """Verify and install one bundle as a session; the store is unchanged on any failure."""
    received = receive_bundle(store, source, source_name=source_name, replace=replace, model=model,
                              as_id=as_id, progress=progress)
    return received.install(replace=replace)


def _point_at_local_model(tmp: Path, model: str | os.PathLike[str]) -> None:
    """The fingerprint matched: record where the model lives on THIS host (resume finds it)."""
    from sessionstore.sessions import TINY_NAME

    src = os.fspath(model)
    path = TINY_NAME if src == TINY_NAME else str(Path(src).resolve())
    manifest = read_manifest(tmp / MANIFEST_NAME)
    if manifest.model.path != path:
        manifest.model = ModelRef(manifest.model.name, path, manifest.model.fingerprint)
        write_manifest(tmp / MANIFEST_NAME, manifest)


def _verify_received(tmp: Path, bm: BundleManifest, manifest: Any, dims: Dims) -> None:
    """What landed must be what the frame described (adopt_dir then re-checks the sidecar)."""
    shipped = parse_json((tmp / MANIFEST_NAME).read_bytes(), f"{tmp / MANIFEST_NAME}")
    if shipped != bm.session:
        raise FormatError(f"{bm.session_id}: manifest.json differs from the manifest frame")
    kv_path = tmp / KV_NAME
    with open(kv_path, "rb") as fh:
        head = fh.read(HEADER_SIZE)
    header = parse_header(head, os.path.getsize(kv_path), kv_path)
    if (header.version, header.dims, header.nrec, header.tag) != (manifest.kv_version, dims, manifest.committed,
                                                                  manifest.kv_tag):
        raise FormatError(f"{kv_path}: header v{header.version} {header.dims.as_tuple()} nrec "
                          f"{header.nrec} differs from the manifest (v{manifest.kv_version} "
                          f"{dims.as_tuple()} nrec {manifest.committed})")
    if header.tag != bm.kv["tag"]:
        raise FormatError(f"{kv_path}: byte 36: tag {header.tag}, the frame says {bm.kv['tag']}")
    if bm.file(CONVERSATION_NAME) is not None:  # it MUST describe exactly the shipped history
        record = read_record(tmp)
        with open_kv(kv_path, expect=dims) as reader:
            history = [int(t) for t in reader.tokens[:manifest.committed]] + list(manifest.pending)
        if record is None or record.turn is not None or not record.agrees_with(history):
            raise FormatError(f"{tmp / CONVERSATION_NAME}: the shipped conversation does not describe the "
                              f"session's {len(history)} tokens")
    if bm.file(RESPONSES_NAME) is not None:
        read_response_list(tmp)  # a JSON array of objects (the service checks each record at its install)
    if bm.file(SIDECAR_NAME) is None:
        with open_kv(kv_path, expect=dims) as reader:
            write_sidecar_for(reader)  # checksums for the store from now on
    else:
        sidecar = load_sidecar(kv_path)
        if sidecar is None or sidecar.static_hash != static_hash(head):
            raise CorruptionError(f"{kv_path}: the shipped sidecar does not describe this header")


__all__ = ["ReceivedBundle", "import_bundle", "check_model", "receive_bundle"]
