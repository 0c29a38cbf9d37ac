"""Export a session as a bundle, import a bundle as a session (the store side of migration).

Export works from a suspended or a live session: it takes the store's snapshot of the last
commit (manifest + header with ``nrec = committed``) and streams it in ONE pass over the
committed bytes (zero-copy mmap views cut at chunk boundaries): before a chunk is sent, every
record it touches is checked against its sidecar entry (a corrupt source stops the stream before
its trailer, so no reader accepts it), then the chunk is hashed and written while hot in the
cache. The committed prefix only changes through a truncate, which bumps the manifest's epoch
first: checked after streaming (the stream is abandoned before its trailer: try again).

Import reads the manifest frame, validates it against the session manifest schema, the layout
limits, the model (``model=``) and the store (id taken without ``replace``), checks the free
space, streams every file into a fresh directory under ``<root>/tmp/`` (payloads read into one
reused buffer, written straight to the file with the disk's write-back started as they land),
verifies every chunk, file digest and the trailer, the kv header and the sidecar, fsyncs, and
installs the directory with one rename (``SessionStore.adopt_dir``). On ANY failure the temp
directory is removed: the store is left exactly as it was.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kernels.errors import ColiError, CorruptionError, FormatError, LimitError, LockedError, ModelMismatchError
from kernels.rows import KV_FORMAT_OF_DTYPE
from sessionstore.kvfile import (
    ENTRY_SIZE,
    HEADER_SIZE,
    SIDECAR_HEADER_SIZE,
    Dims,
    Durability,
    load_sidecar,
    open_kv,
    pack_header,
    parse_header,
    record_bytes,
    record_checksum,
    sidecar_bytes,
    static_hash,
    validate_dims,
    write_sidecar_for,
)
from sessionstore.log import get_logger
from sessionstore.migration import bundle as B
from sessionstore.migration.bundle_io import WritebackFile
from sessionstore.sessions import (
    CONVERSATION_NAME,
    KV_NAME,
    MANIFEST_NAME,
    SIDECAR_NAME,
    ModelRef,
    SessionSnapshot,
    SessionStore,
    manifest_from_json,
    read_manifest,
    read_record,
    write_manifest,
)

log = get_logger("migrate")

FREE_SPACE_MARGIN = 64 << 20  # left free on the store's filesystem after an import
RELEASE_BYTES = 64 << 20  # export unmaps the records it has sent every this many bytes
assert (MANIFEST_NAME, KV_NAME, SIDECAR_NAME, CONVERSATION_NAME) == B.ALLOWED_FILES


@dataclass(frozen=True)
class MigrateResult:
    """What one export or import moved."""

    session_id: str
    tokens: int
    kv_dtype: str
    raw_bytes: int
    stored_bytes: int
    chunks: int
    zstd_chunks: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "ratio": round(self.ratio, 4)}


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not (enabled and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)


class _ExportSource:
    """The snapshot's bytes, served chunk by chunk in one pass, every record checked first."""

    def __init__(self, snap: SessionSnapshot, chunk_bytes: int) -> None:
        self.snap = snap
        self.chunk_bytes = chunk_bytes
        self.reader = open_kv(snap.kv_path, expect=snap.header.dims)
        try:
            self._prepare()
        except BaseException:
            self.reader.close()
            raise

    def _prepare(self) -> None:
        snap, reader = self.snap, self.reader
        n, rec = snap.committed, snap.header.record_bytes
        if reader.version != snap.header.version or reader.nrec < n:
            raise CorruptionError(f"{reader.path}: v{reader.version} with {reader.nrec} records "
                                  f"does not hold the snapshot (v{snap.header.version}, {n})")
        self.manifest_json = snap.manifest.encode()
        self.header_bytes = pack_header(snap.header)  # the engine's header, nrec = committed
        sidecar = load_sidecar(reader.path)
        self.entries = None
        if sidecar is not None:
            if sidecar.static_hash != static_hash(self.header_bytes) or sidecar.record_bytes != rec:
                raise CorruptionError(f"{sidecar.path}: describes another header or record size "
                                      f"than {reader.path}; run `coli-kv verify` on the session")
            vouched = min(sidecar.count, sidecar.available, n)
            if vouched < n:  # a session's sidecar vouches for every committed record
                raise CorruptionError(
                    f"{reader.path}: its sidecar vouches for {vouched} of the {n} committed "
                    f"records (count {sidecar.count}, {sidecar.available} entries on disk: rewound "
                    "or cut short); refusing to export rows it cannot vouch for")
            self.entries = sidecar.entries[:vouched]  # [n] u64
        self.sidecar = (None if self.entries is None
                        else sidecar_bytes(self.header_bytes, rec, self.entries))
        history = [int(t) for t in reader.tokens[:n]] + list(snap.manifest.pending)
        record = read_record(snap.kv_path.parent)  # the messages go along when they describe it
        self.conversation = record.encode() if record is not None and record.turn is None and \
            record.agrees_with(history) else None
        sizes = {MANIFEST_NAME: len(self.manifest_json), KV_NAME: HEADER_SIZE + n * rec}
        if self.sidecar is not None:
            sizes[SIDECAR_NAME] = len(self.sidecar)
        if self.conversation is not None:
            sizes[CONVERSATION_NAME] = len(self.conversation)
        self.files = tuple(B.BundleFile(name, size) for name, size in sizes.items())

    def kv_chunks(self) -> Iterator[bytes | memoryview]:
        """The kv file's bytes cut at chunk boundaries: the header (nrec = committed) and the
        committed records, as zero-copy views of the mapping (chunk 0 only is joined to the
        header); every record a chunk touches is checked against its sidecar entry before the
        chunk is handed out."""
        n, rec, cb = self.snap.committed, self.snap.header.record_bytes, self.chunk_bytes
        body = self.reader.records_bytes_view(0, n) if n else memoryview(b"")
        total = HEADER_SIZE + len(body)
        checked = released = 0  # records [0, checked) verified, [0, released) unmapped
        for start in range(0, total, cb):
            end = min(start + cb, total)
            if self.entries is not None:
                checked = self._check(body, checked, -(-(end - HEADER_SIZE) // rec))
            if start == 0:
                yield self.header_bytes + body[:end - HEADER_SIZE]
            else:
                yield body[start - HEADER_SIZE:end - HEADER_SIZE]
            sent = (end - HEADER_SIZE) // rec  # records [0, sent) are written: unmap them
            if (sent - released) * rec >= RELEASE_BYTES:
                self.reader.release_pages(released, sent)
                released = sent

    def _check(self, body: memoryview, first: int, stop: int) -> int:
        """Compare records [first, stop) with their sidecar entries (those it covers)."""
        entries, rec = self.entries, self.snap.header.record_bytes
        assert entries is not None
        for p in range(first, min(stop, entries.shape[0])):
            found = record_checksum(body[p * rec:(p + 1) * rec], p)
            if found != int(entries[p]):
                raise CorruptionError(
                    f"{self.reader.path}: byte {HEADER_SIZE + p * rec}: record {p} hashes "
                    f"{found:#018x}, the sidecar vouches for {int(entries[p]):#018x}; "
                    "refusing to export a corrupt session (the bundle was abandoned)")
        return max(first, stop)

    def close(self) -> None:
        self.reader.close(defer_unmap=True)


def kv_info(snap: SessionSnapshot) -> dict[str, Any]:
    h = snap.header
    return {"version": h.version, "dtype": snap.manifest.kv_dtype, "nrec": snap.committed,
            "record_bytes": h.record_bytes, "tag": h.tag, "dims": dict(snap.manifest.dims)}


def export_session(store: SessionStore, session_id: str, sink: BinaryIO, *,
                   compression: str | int = "auto", chunk_bytes: int = B.DEFAULT_CHUNK_BYTES,
                   progress: bool = False) -> MigrateResult:
    """Write ``session_id`` (its last commit) to ``sink`` as one bundle, in one pass."""
    start = time.perf_counter()
    snap = store.snapshot(session_id)
    source = _ExportSource(snap, chunk_bytes)
    try:
        manifest = B.BundleManifest(
            session_id=session_id, session=snap.manifest.to_json(), kv=kv_info(snap),
            files=source.files, chunk_bytes=chunk_bytes,
            created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            producer="coli-sessionstore")
        bar = _progress(manifest.total_bytes, f"export {session_id}", progress)
        try:
            writer = B.BundleWriter(sink, manifest, B.CompressionPolicy(compression), bar)
            writer.write_file(MANIFEST_NAME, [source.manifest_json])
            try:
                writer.write_file(KV_NAME, source.kv_chunks())
            except CorruptionError:
                if snap.still_valid():
                    raise
                _changed_while_exporting(session_id)
            if source.sidecar is not None:
                writer.write_file(SIDECAR_NAME, [source.sidecar])
            if source.conversation is not None:
                writer.write_file(CONVERSATION_NAME, [source.conversation])
            if not snap.still_valid():
                _changed_while_exporting(session_id)
            stats = writer.finish()
        finally:
            if bar is not None:
                bar.close()
    finally:
        source.close()
    result = MigrateResult(session_id, snap.committed, snap.manifest.kv_dtype, stats.raw_bytes,
                           stats.stored_bytes, stats.chunks, stats.zstd_chunks,
                           time.perf_counter() - start)
    log.info("bundle.export", id=session_id, tokens=snap.committed, raw_bytes=stats.raw_bytes,
             stored_bytes=stats.stored_bytes, zstd_chunks=stats.zstd_chunks)
    return result


def _changed_while_exporting(session_id: str) -> None:
    log.info("bundle.export_abandoned", id=session_id, reason="truncated by its live writer")
    raise LockedError(f"session {session_id!r} was truncated by its live writer while being "
                      "exported; the bundle was abandoned (no trailer): try again")


# --- import ----------------------------------------------------------------------------------
def _check_frame(bm: B.BundleManifest, where: str) -> tuple[Any, Dims, int]:
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
    try:
        for entry in reader.manifest.files:
            out = WritebackFile.create(tmp / entry.name)
            outs.append(out)
            for raw in reader.iter_file(entry.name, copy=False):
                out.write(raw)
                if bar is not None:
                    bar.update(len(raw))
        _fsync_all([out.fileno() for out in outs])
    finally:
        for out in outs:
            out.close()


def _fsync_all(fds: Sequence[int]) -> None:
    io = Durability()
    try:
        io.fsync_all(fds)
    finally:
        io.release()


def import_bundle(store: SessionStore, source: BinaryIO, *, source_name: str = "<bundle>",
                  replace: bool = False, model: str | os.PathLike[str] | None = None,
                  as_id: str | None = None, progress: bool = False) -> MigrateResult:
    """Verify and install one bundle as a session; the store is unchanged on any failure."""
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
    tmp = store.tmp_dir()
    bar = None
    try:
        bar = _progress(bm.total_bytes, f"import {session_id}", progress)
        _receive(reader, tmp, bar)
        stats = reader.finish()
        _verify_received(tmp, bm, manifest, dims)
        if model is not None:
            _point_at_local_model(tmp, model)
        info = store.adopt_dir(tmp, session_id, replace=replace)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("bundle.import_failed", id=session_id, source=source_name,
                    error=str(exc) if isinstance(exc, ColiError) else repr(exc))
        raise
    finally:
        if bar is not None:
            bar.close()
    result = MigrateResult(session_id, info.tokens, info.kv_dtype, stats.raw_bytes,
                           stats.stored_bytes, stats.chunks, stats.zstd_chunks,
                           time.perf_counter() - start)
    log.info("bundle.import", id=session_id, tokens=info.tokens, raw_bytes=stats.raw_bytes,
             replace=replace)
    return result


def _point_at_local_model(tmp: Path, model: str | os.PathLike[str]) -> None:
    """The fingerprint matched: record where the model lives on THIS host (resume finds it)."""
    from sessionstore.sessions import TINY_NAME

    src = os.fspath(model)
    path = TINY_NAME if src == TINY_NAME else str(Path(src).resolve())
    manifest = read_manifest(tmp / MANIFEST_NAME)
    if manifest.model.path != path:
        manifest.model = ModelRef(manifest.model.name, path, manifest.model.fingerprint)
        write_manifest(tmp / MANIFEST_NAME, manifest)


def _verify_received(tmp: Path, bm: B.BundleManifest, manifest: Any, dims: Dims) -> None:
    """What landed must be what the frame described (adopt_dir then re-checks the sidecar)."""
    shipped = B.parse_json((tmp / MANIFEST_NAME).read_bytes(), f"{tmp / MANIFEST_NAME}")
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
    if bm.file(SIDECAR_NAME) is None:
        with open_kv(kv_path, expect=dims) as reader:
            write_sidecar_for(reader)  # checksums for the store from now on
    else:
        sidecar = load_sidecar(kv_path)
        if sidecar is None or sidecar.static_hash != static_hash(head):
            raise CorruptionError(f"{kv_path}: the shipped sidecar does not describe this header")


__all__ = ["MigrateResult", "export_session", "import_bundle", "check_model",
           "kv_info"]
