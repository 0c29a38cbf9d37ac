"""Assemble a session from its shipped chain (FORMAT.md 6.7.4): the base bundle, then every
segment of the chain (walked back from the head's last one), into ONE bundle that the ordinary verified import installs.

The base bundle's files are read through :class:`BundleReader` (every chunk, file digest and the
trailer checked); each segment is checked against the size and digest its successor (or the head)
names and its own trailer
(:func:`parse_segment`); its records must start exactly where the chain so far ends, or, for a cut
segment (version 2), below it: the cut's records replace the chain's from its ``start`` on. The result is
re-framed as a bundle in a temporary file and handed to :func:`import_bundle`, so the install
checks are the import's own (kv header, sidecar over every record, token ids, model fingerprint,
one rename). Memory stays a few chunks plus one segment; the kv bytes live in a temporary file.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any, BinaryIO

from kernels.errors import CorruptionError, FormatError, LimitError
from sessionstore.kvfile import ENTRY_SIZE, HEADER_SIZE, SIDECAR_HEADER_SIZE
from sessionstore.migration import bundle as B
from sessionstore.migration.bundle_compress import CompressionPolicy
from sessionstore.migration.bundle_format import BundleFile, BundleManifest, parse_json
from sessionstore.migration.exporting import MigrateResult
from sessionstore.migration.migrate import import_bundle
from sessionstore.migration.object_store import ObjectPrefix
from sessionstore.migration.segment_format import (
    CUT_SEGMENT_VERSION,
    META_PREFIX_BYTES,
    Head,
    Segment,
    SegmentRef,
    parse_segment,
    segment_prev,
)
from sessionstore.migration.transport import open_source
from sessionstore.sessions import SessionStore

KV, SIDECAR = "kv.coli_kv", "kv.coli_kv.colisum"
SMALL = ("manifest.json", "conversation.json", "responses.json")
PIECE_BYTES = 4 << 20


class ChainFiles:
    """The session's files as the chain so far describes them: kv and sidecar in temp files."""

    def __init__(self, directory: str) -> None:
        self.kv = open(os.path.join(directory, "kv"), "w+b")  # closed by close()
        self.sidecar = open(os.path.join(directory, "sidecar"), "w+b")
        self.small: dict[str, bytes] = {}
        self.kv_info: dict[str, Any] | None = None
        self.nrec = 0

    def close(self) -> None:
        self.kv.close()
        self.sidecar.close()

    def load_base(self, source: BinaryIO, name: str) -> None:
        """The base bundle's files (read and verified front to back)."""
        reader = B.BundleReader(source, name)
        for entry in reader.manifest.files:
            out = {KV: self.kv, SIDECAR: self.sidecar}.get(entry.name)
            data = bytearray()
            for piece in reader.iter_file(entry.name):
                if out is not None:
                    out.write(piece)
                else:
                    data += piece
            if out is None:
                self.small[entry.name] = bytes(data)
        reader.finish()
        self.kv_info = dict(reader.manifest.kv)
        self.nrec = int(self.kv_info["nrec"])

    def apply(self, seg: Segment, where: str) -> None:
        """Records ``[seg.start, seg.nrec)`` written over the chain's from ``seg.start`` (appended; a
        cut segment's start lies below the chain's end, and the records past it are dropped),
        headers and small files replaced."""
        if seg.version == CUT_SEGMENT_VERSION:
            if seg.start >= self.nrec:
                raise CorruptionError(f"{where}: a cut at record {seg.start}, the chain so far ends at {self.nrec}")
        elif seg.start != self.nrec:
            raise CorruptionError(f"{where}: starts at record {seg.start}, the chain so far ends at {self.nrec}")
        if self.kv_info is not None and int(self.kv_info["record_bytes"]) != seg.record_bytes:
            raise FormatError(f"{where}: records of {seg.record_bytes} bytes, the chain's are "
                              f"{self.kv_info['record_bytes']}")
        rec = seg.record_bytes
        self.kv.seek(HEADER_SIZE + seg.start * rec)
        self.kv.write(seg.parts["records"])
        self.kv.seek(0)
        self.kv.write(seg.parts["kv_header"])
        self.sidecar.seek(SIDECAR_HEADER_SIZE + seg.start * ENTRY_SIZE)
        self.sidecar.write(seg.parts["entries"])
        self.sidecar.seek(0)
        self.sidecar.write(seg.parts["sidecar_header"])
        self.small = {name: seg.parts[name] for name in SMALL if name in seg.parts}
        self.kv_info, self.nrec = dict(seg.kv), seg.nrec

    def write_bundle(self, session_id: str, sink: BinaryIO) -> None:
        """The assembled session as one bundle (raw chunks) into ``sink``."""
        if self.kv_info is None or "manifest.json" not in self.small:
            raise FormatError(f"session {session_id!r}: the chain holds no commit (no base, no segment)")
        rec = int(self.kv_info["record_bytes"])
        sizes = {"manifest.json": len(self.small["manifest.json"]), KV: HEADER_SIZE + self.nrec * rec,
                 SIDECAR: SIDECAR_HEADER_SIZE + self.nrec * ENTRY_SIZE}
        for name in SMALL[1:]:
            if name in self.small:
                sizes[name] = len(self.small[name])
        manifest = BundleManifest(
            session_id=session_id, session=parse_json(self.small["manifest.json"], "chain manifest.json"),
            kv=self.kv_info, files=tuple(BundleFile(n, s) for n, s in sizes.items()),
            producer="coli-sessionstore chain")
        writer = B.BundleWriter(sink, manifest, CompressionPolicy("none"))
        writer.write_file("manifest.json", [self.small["manifest.json"]])
        writer.write_file(KV, _pieces(self.kv, sizes[KV]))
        writer.write_file(SIDECAR, _pieces(self.sidecar, sizes[SIDECAR]))
        for name in SMALL[1:]:
            if name in self.small:
                writer.write_file(name, [self.small[name]])
        writer.finish()


def _pieces(f: BinaryIO, size: int) -> Iterator[bytes]:
    """The first ``size`` bytes of ``f`` in pieces (a short file is corruption, named)."""
    f.seek(0)
    left = size
    while left:
        piece = f.read(min(PIECE_BYTES, left))
        if not piece:
            raise CorruptionError(f"chain assembly: {left} bytes missing of {size}")
        left -= len(piece)
        yield piece


def fetch_segment(objects: ObjectPrefix, key: str, size: int) -> bytes:
    """One segment object's bytes, its size checked against the head's before reading."""
    resp = objects.call("get_object", Key=key)
    found = int(resp.get("ContentLength") or 0)
    if found != size:
        raise LimitError(f"{objects.url_of(key)}: {found} bytes, the head lists {size}")
    from fsspec.asyn import sync

    data: bytes = sync(objects.fs.loop, resp["Body"].read)
    return data


def chain_refs(objects: ObjectPrefix, head: Head, segment_key: Any) -> list[SegmentRef]:
    """The head's segments, first to last: walked back from ``head.last`` through each segment's
    ``prev`` (read from its first bytes; every object is checked whole before it is applied)."""
    refs: list[SegmentRef] = []
    ref = head.last
    while ref is not None:
        if len(refs) >= head.count:
            raise CorruptionError(f"session {head.session_id!r}: its chain is longer than the "
                                  f"{head.count} segments its head counts")
        key = segment_key(head.session_id, ref.name)
        with objects.failing(f"takeover (reading segment {ref.name})", head.session_id):
            resp = objects.call("get_object", Key=key, Range=f"bytes=0-{META_PREFIX_BYTES - 1}")
            from fsspec.asyn import sync

            prefix: bytes = sync(objects.fs.loop, resp["Body"].read)
        refs.append(ref)
        ref = segment_prev(prefix, objects.url_of(key))
    if len(refs) != head.count:
        raise CorruptionError(f"session {head.session_id!r}: its chain has {len(refs)} segments, its "
                              f"head counts {head.count}")
    return refs[::-1]


def assemble(objects: ObjectPrefix, head: Head, segment_key: Any, store: SessionStore, *,
             model: str | os.PathLike[str] | None = None) -> MigrateResult:
    """Install ``head``'s chain as the session (replacing the local copy); ``segment_key(id,
    name)`` is the object key of a segment the head lists."""
    sid = head.session_id
    if head.count == 0 and head.base is not None:  # the base alone: streamed straight into the import
        with objects.failing(f"takeover (downloading base bundle {head.base.rsplit('/', 1)[-1]})", sid), \
                open_source(objects.url_of(head.base), storage_options=objects.storage_options) as src:
            return import_bundle(store, src, source_name=objects.url_of(head.base), replace=True, model=model)
    with tempfile.TemporaryDirectory(prefix="coli-chain-") as tmp:
        files = ChainFiles(tmp)
        try:
            if head.base is not None:
                with objects.failing(f"takeover (downloading base bundle {head.base.rsplit('/', 1)[-1]})", sid), \
                        open_source(objects.url_of(head.base), storage_options=objects.storage_options) as src:
                    files.load_base(src, objects.url_of(head.base))
            for ref in chain_refs(objects, head, segment_key):
                key = segment_key(sid, ref.name)
                with objects.failing(f"takeover (downloading segment {ref.name})", sid):
                    data = fetch_segment(objects, key, ref.size)
                seg = parse_segment(data, objects.url_of(key), session_id=sid, digest=ref.digest)
                if (seg.start, seg.nrec) != (ref.start, ref.nrec):
                    raise CorruptionError(f"{objects.url_of(key)}: records [{seg.start}, {seg.nrec}), its "
                                          f"successor names [{ref.start}, {ref.nrec})")
                files.apply(seg, objects.url_of(key))
            if files.nrec != head.nrec:
                raise CorruptionError(f"session {sid!r}: the chain holds {files.nrec} records, "
                                      f"its head says {head.nrec}")
            with open(os.path.join(tmp, "bundle"), "w+b") as bundle:
                files.write_bundle(sid, bundle)
                bundle.seek(0)
                return import_bundle(store, bundle, source_name=f"{objects.url} chain of {sid!r}",
                                     replace=True, model=model)
        finally:
            files.close()


__all__ = ["ChainFiles", "assemble", "chain_refs", "fetch_segment"]
