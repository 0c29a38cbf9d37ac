"""Export a session as a bundle (FORMAT.md 6.3), in ONE pass over its committed bytes.

Export works from a suspended or a live session: it takes the store's snapshot of the last
commit (manifest + header with ``nrec = committed``) and streams it as zero-copy mmap views cut at
chunk boundaries: before a chunk is sent, every record it touches is checked against its sidecar
entry (a corrupt source stops the stream before its trailer, so no reader accepts it), then the
chunk is hashed and written while hot in the cache. The committed prefix only changes through a
truncate, which bumps the manifest's epoch first: checked after streaming (the stream is
abandoned before its trailer: try again). The session's conversation goes along when it
describes the snapshot (FORMAT.md 5.8).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from kernels.errors import CorruptionError, LockedError
from sessionstore.kvfile import (
    HEADER_SIZE,
    load_sidecar,
    open_kv,
    pack_header,
    record_checksums,
    sidecar_bytes,
    static_hash,
)
from sessionstore.log import get_logger
from sessionstore.migration import bundle as B
from sessionstore.migration.bundle_compress import CompressionPolicy, policy_of
from sessionstore.migration.bundle_format import DEFAULT_CHUNK_BYTES, BundleFile, BundleManifest
from sessionstore.sessions import (
    CONVERSATION_NAME,
    KV_NAME,
    MANIFEST_NAME,
    RESPONSES_NAME,
    SIDECAR_NAME,
    SessionSnapshot,
    SessionStore,
    read_record,
    response_list_bytes,
)

log = get_logger("migrate")

RELEASE_BYTES = 64 << 20  # export unmaps the records it has sent every this many bytes


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


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not (enabled and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)


class ExportSource:
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
        self.responses = response_list_bytes(snap.kv_path.parent)  # its stored responses go along
        sizes = {MANIFEST_NAME: len(self.manifest_json), KV_NAME: HEADER_SIZE + n * rec}
        if self.sidecar is not None:
            sizes[SIDECAR_NAME] = len(self.sidecar)
        if self.conversation is not None:
            sizes[CONVERSATION_NAME] = len(self.conversation)
        if self.responses is not None:
            sizes[RESPONSES_NAME] = len(self.responses)
        self.files = tuple(BundleFile(name, size) for name, size in sizes.items())

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
        last = min(stop, entries.shape[0])
        if last > first:
            hashes = record_checksums(body[first * rec:last * rec], rec, first)  # [last - first] u64
            wrong = np.flatnonzero(hashes != entries[first:last])  # [m] offsets from ``first``
            if wrong.size:
                p, found = first + int(wrong[0]), int(hashes[wrong[0]])
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


class PreparedExport:
    """One session's last commit, opened for export with its bundle manifest decided (so the
    bundle's size is known before a byte is written when every chunk is stored raw). ``write``
    streams it once; ``close`` lets go of the kv mapping. A context manager."""

    def __init__(self, store: SessionStore, session_id: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.session_id = session_id
        self.snap = store.snapshot(session_id)
        self.source = ExportSource(self.snap, chunk_bytes)
        try:
            self.manifest = BundleManifest(
                session_id=session_id, session=self.snap.manifest.to_json(), kv=kv_info(self.snap),
                files=self.source.files, chunk_bytes=chunk_bytes,
                created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                producer="coli-sessionstore")
        except BaseException:
            self.source.close()
            raise

    def raw_bundle_bytes(self) -> int:
        """The bundle's exact size when written with ``compression="none"``."""
        return self.manifest.raw_bundle_bytes()

    def write(self, sink: BinaryIO, *, compression: str | int | CompressionPolicy = "auto",
              progress: bool = False) -> MigrateResult:
        """Write the bundle to ``sink`` in one pass over the committed bytes."""
        start = time.perf_counter()
        snap, source, session_id = self.snap, self.source, self.session_id
        bar = progress_bar(self.manifest.total_bytes, f"export {session_id}", progress)
        try:
            writer = B.BundleWriter(sink, self.manifest, policy_of(compression), bar)
            writer.write_file(MANIFEST_NAME, [source.manifest_json])
            try:
                writer.write_file(KV_NAME, source.kv_chunks())
            except CorruptionError:
                if snap.still_valid():
                    raise
                changed_while_exporting(session_id)
            if source.sidecar is not None:
                writer.write_file(SIDECAR_NAME, [source.sidecar])
            if source.conversation is not None:
                writer.write_file(CONVERSATION_NAME, [source.conversation])
            if source.responses is not None:
                writer.write_file(RESPONSES_NAME, [source.responses])
            if not snap.still_valid():
                changed_while_exporting(session_id)
            stats = writer.finish()
        finally:
            if bar is not None:
                bar.close()
        result = MigrateResult(session_id, snap.committed, snap.manifest.kv_dtype, stats.raw_bytes,
                               stats.stored_bytes, stats.chunks, stats.zstd_chunks,
                               time.perf_counter() - start)
        log.info("bundle.export", id=session_id, tokens=snap.committed, raw_bytes=stats.raw_bytes,
                 stored_bytes=stats.stored_bytes, zstd_chunks=stats.zstd_chunks)
        return result

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> PreparedExport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def export_session(store: SessionStore, session_id: str, sink: BinaryIO, *,
                   compression: str | int | CompressionPolicy = "auto", chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                   progress: bool = False) -> MigrateResult:
    """Write ``session_id`` (its last commit) to ``sink`` as one bundle, in one pass."""
    with PreparedExport(store, session_id, chunk_bytes) as export:
        return export.write(sink, compression=compression, progress=progress)


def changed_while_exporting(session_id: str) -> None:
    log.info("bundle.export_abandoned", id=session_id, reason="truncated by its live writer")
    raise LockedError(f"session {session_id!r} was truncated by its live writer while being "
                      "exported; the bundle was abandoned (no trailer): try again")


# --- import ----------------------------------------------------------------------------------


__all__ = ["ExportSource", "MigrateResult", "PreparedExport", "RELEASE_BYTES", "changed_while_exporting",
           "export_session", "kv_info", "progress_bar"]
