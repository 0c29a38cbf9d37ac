"""The bytes of a turn's segment object and of a session's head object (FORMAT.md 6.7).

A *segment* carries what one shipped turn added to a session: its new kv records, their sidecar
entries, the kv and sidecar headers as they read after the turn, and the session's small files
(manifest, conversation, responses) whole. Layout (little-endian)::

    preamble   16 B   b"COLISEGM", u32 version (1; 2 for a cut), u32 flags (0)
    meta       16 B   b"SGMT", u32 json_len, u64 xxh3_64(json)   + json_len bytes of UTF-8 JSON
    parts             the parts the JSON lists, in its order, back to back
    trailer    32 B   b"SGTR", u32 0, 16s xxh3_128(every byte before the trailer), b"COLISEND"

Each segment names the one before it (``prev``: name, records, size, whole-object digest; null
for the first after the base), so the segments form a chain (a *cut* segment, version 2, starts
below the chain's end: its records replace the chain's from ``start`` on) whose *head* (``heads/<id>.json``, a
fixed few hundred bytes) names the base bundle (or none) and the last segment. This module encodes
and parses (and checks a segment's records against their sidecar entries before it is encoded,
:func:`check_records`); the object store side is :mod:`sessionstore.migration.chain_objects` and
:mod:`sessionstore.migration.shipping`.
"""
from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import xxhash

from kernels.errors import CorruptionError, FormatError, LimitError
from sessionstore.kvfile import ENTRY_SIZE, HEADER_SIZE, SIDECAR_HEADER_SIZE, record_checksums
from sessionstore.migration.bundle_format import (
    MAX_CONVERSATION_BYTES,
    MAX_RESPONSES_BYTES,
    check_session_id,
    parse_json,
)

SEGMENT_MAGIC = b"COLISEGM"
SEGMENT_END = b"COLISEND"
SEGMENT_VERSION = 1  # a segment that appends: records [start, nrec) with start = the chain's end
CUT_SEGMENT_VERSION = 2  # a cut: start below the chain's end, its records replace the chain's from there
META_TAG = b"SGMT"
TRAILER_TAG = b"SGTR"
PREAMBLE = struct.Struct("<8sII")
META_HEAD = struct.Struct("<4sIQ")
TRAILER = struct.Struct("<4sI16s8s")
assert PREAMBLE.size == 16 and META_HEAD.size == 16 and TRAILER.size == 32

MAX_SEGMENT_META_BYTES = 64 << 10
MAX_SEGMENT_BYTES = 1 << 36  # 64 GiB: one turn's records of the largest models, far above any turn
MAX_HEAD_BYTES = 64 << 10
MAX_CHAIN_SEGMENTS = 1024  # a chain holds at most this many; the shipper compacts before
HEAD_FORMAT = "coli-head"
HEAD_VERSION = 1

# the parts of a segment, in this order; the three small files may be absent (size -1 in no list)
PART_NAMES = ("kv_header", "records", "sidecar_header", "entries", "manifest.json", "conversation.json",
              "responses.json")
SMALL_LIMITS = {"manifest.json": 1 << 20, "conversation.json": MAX_CONVERSATION_BYTES,
                "responses.json": MAX_RESPONSES_BYTES}


@dataclass(frozen=True)
class Segment:
    """One parsed segment: records ``[start, nrec)`` of ``session_id`` and the files after them."""

    session_id: str
    generation: int
    start: int
    nrec: int
    record_bytes: int
    kv: dict[str, Any]  # the bundle manifest's kv member as it reads after the turn (FORMAT.md 6.1)
    parts: dict[str, bytes]  # PART_NAMES -> bytes (absent small files missing)
    prev: SegmentRef | None  # the segment before this one (None: the first after the base)
    version: int = SEGMENT_VERSION  # CUT_SEGMENT_VERSION: a cut (``start`` below the chain's end)

    @property
    def count(self) -> int:
        return self.nrec - self.start


def encode_segment(session_id: str, generation: int, start: int, kv: dict[str, Any],
                   parts: dict[str, bytes | memoryview], prev: SegmentRef | None, *, cut: bool = False) -> bytes:
    """The segment object's bytes (records ``[start, kv['nrec'])``); parts as PART_NAMES lists.
    ``cut``: ``start`` lies below the chain's end (a version-2 segment, which a reader of version 1
    refuses rather than misreads: FORMAT.md 6.7.1)."""
    rec, nrec = int(kv["record_bytes"]), int(kv["nrec"])
    version = CUT_SEGMENT_VERSION if cut else SEGMENT_VERSION
    assert len(parts["records"]) == (nrec - start) * rec and len(parts["entries"]) == (nrec - start) * ENTRY_SIZE
    listed = [(name, len(parts[name])) for name in PART_NAMES if name in parts]
    meta = json.dumps({"format": "coli-segment", "version": version, "session_id": session_id,
                       "generation": generation, "start": start, "kv": kv,
                       "prev": None if prev is None else asdict(prev),
                       "parts": [{"name": n, "size": s} for n, s in listed]}, sort_keys=True).encode()
    out = bytearray(PREAMBLE.pack(SEGMENT_MAGIC, version, 0))
    out += META_HEAD.pack(META_TAG, len(meta), xxhash.xxh3_64_intdigest(meta)) + meta
    for name, _ in listed:
        out += parts[name]
    out += TRAILER.pack(TRAILER_TAG, 0, xxhash.xxh3_128_digest(bytes(out)), SEGMENT_END)
    return bytes(out)


def digest_of(data: bytes) -> str:
    """The whole-object digest a head lists for a segment: xxh3_128, hex."""
    return xxhash.xxh3_128_hexdigest(data)


def parse_segment(data: bytes, where: str, *, session_id: str, digest: str) -> Segment:
    """Check and parse a segment object; CorruptionError / FormatError naming ``where``."""
    if len(data) < PREAMBLE.size + META_HEAD.size + TRAILER.size:
        raise CorruptionError(f"{where}: {len(data)} bytes is shorter than any segment")
    if digest_of(data) != digest:
        raise CorruptionError(f"{where}: digest {digest_of(data)} differs from the one its successor "
                              f"(or the head) names, {digest}")
    tag, trailer_flags, whole, end = TRAILER.unpack_from(data, len(data) - TRAILER.size)
    if tag != TRAILER_TAG or trailer_flags != 0 or end != SEGMENT_END:
        raise CorruptionError(f"{where}: byte {len(data) - TRAILER.size}: no segment trailer")
    if whole != xxhash.xxh3_128_digest(data[:len(data) - TRAILER.size]):
        raise CorruptionError(f"{where}: the trailer's digest does not match the segment's bytes")
    meta, json_len, version = _meta(data, where)
    body_at = PREAMBLE.size + META_HEAD.size
    try:
        if check_session_id(meta["session_id"], where) != session_id:
            raise FormatError(f"{where}: a segment of session {meta['session_id']!r}, not {session_id!r}")
        kv = dict(meta["kv"])
        rec, nrec, start = int(kv["record_bytes"]), int(kv["nrec"]), int(meta["start"])
        listed = [(str(p["name"]), int(p["size"])) for p in meta["parts"]]
        generation = int(meta["generation"])
        prev = _ref(meta["prev"], where)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{where}: segment meta field missing or of the wrong type ({exc})") from None
    if not (rec > 0 and 0 <= start <= nrec):
        raise FormatError(f"{where}: records [{start}, {nrec}) of {rec} bytes is not a range")
    want = {"kv_header": HEADER_SIZE, "records": (nrec - start) * rec, "sidecar_header": SIDECAR_HEADER_SIZE,
            "entries": (nrec - start) * ENTRY_SIZE}
    names = [n for n, _ in listed]
    if names != [n for n in PART_NAMES if n in names] or not set(want) <= set(names) or "manifest.json" not in names:
        raise FormatError(f"{where}: segment parts {names} are not the required ones in order")
    parts: dict[str, bytes] = {}
    at = body_at + json_len
    for name, size in listed:
        if size != want.get(name, size) or size < 0 or size > SMALL_LIMITS.get(name, MAX_SEGMENT_BYTES):
            bound = want.get(name, f"at most {SMALL_LIMITS.get(name, MAX_SEGMENT_BYTES)}")
            raise LimitError(f"{where}: part {name} of {size} bytes (expected {bound})")
        if at + size > len(data) - TRAILER.size:
            raise CorruptionError(f"{where}: byte {at}: part {name} of {size} bytes runs past the trailer")
        parts[name] = data[at:at + size]
        at += size
    if at != len(data) - TRAILER.size:
        raise CorruptionError(f"{where}: byte {at}: {len(data) - TRAILER.size - at} stray bytes before the trailer")
    return Segment(session_id, generation, start, nrec, rec, kv, parts, prev, version)


def _meta(data: bytes, where: str) -> tuple[dict[str, Any], int, int]:
    """(the meta JSON, its length, the version) of a segment's first bytes (preamble, meta frame)."""
    magic, version, flags = PREAMBLE.unpack_from(data, 0)
    if magic != SEGMENT_MAGIC or version not in (SEGMENT_VERSION, CUT_SEGMENT_VERSION) or flags != 0:
        raise FormatError(f"{where}: not a version-{SEGMENT_VERSION} or -{CUT_SEGMENT_VERSION} segment "
                          f"(magic {magic!r}, version {version}, flags {flags})")
    tag, json_len, check = META_HEAD.unpack_from(data, PREAMBLE.size)
    body_at = PREAMBLE.size + META_HEAD.size
    if tag != META_TAG or not 1 <= json_len <= MAX_SEGMENT_META_BYTES or body_at + json_len > len(data):
        raise FormatError(f"{where}: byte {PREAMBLE.size}: bad segment meta frame (tag {tag!r}, {json_len} bytes)")
    meta_raw = data[body_at:body_at + json_len]
    if xxhash.xxh3_64_intdigest(meta_raw) != check:
        raise CorruptionError(f"{where}: the segment meta's checksum does not match")
    meta = parse_json(meta_raw, where)
    if not isinstance(meta, dict) or meta.get("format") != "coli-segment" or meta.get("version") != version:
        raise FormatError(f"{where}: not a coli-segment version {version}")
    return meta, json_len, version


def _ref(doc: Any, where: str) -> SegmentRef | None:
    if doc is None:
        return None
    ref = SegmentRef(str(doc["name"]), int(doc["start"]), int(doc["nrec"]), int(doc["size"]), str(doc["digest"]))
    if "/" in ref.name or not 0 <= ref.size <= MAX_SEGMENT_BYTES or not 0 <= ref.start <= ref.nrec:
        raise LimitError(f"{where}: a segment reference out of bounds ({ref})")
    return ref


META_PREFIX_BYTES = PREAMBLE.size + META_HEAD.size + MAX_SEGMENT_META_BYTES  # enough to read any meta


def segment_prev(prefix: bytes, where: str) -> SegmentRef | None:
    """The ``prev`` reference from a segment's first bytes (at most META_PREFIX_BYTES); the
    whole object is checked later, before any of it is used."""
    meta, _, _ = _meta(prefix, where)
    try:
        return _ref(meta["prev"], where)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{where}: segment meta field missing or of the wrong type ({exc})") from None


@dataclass(frozen=True)
class SegmentRef:
    """One segment as the head lists it: its object name, its records and its bytes' digest."""

    name: str
    start: int
    nrec: int
    size: int
    digest: str


@dataclass(frozen=True)
class Head:
    """The head object (``heads/<id>.json``): the chain ``base`` + ``segments`` of one session."""

    session_id: str
    generation: int  # the lease generation of the host that wrote it (its fence)
    owner: str
    lease_bundle: str | None  # the lease's bundle pointer this chain extends (else the head is stale)
    base: str | None  # the chain's base bundle key (None: the chain starts from an empty session)
    base_tokens: int
    nrec: int  # records base + segments hold
    last: SegmentRef | None = None  # the chain's last segment (None: just the base)
    count: int = 0  # segments in the chain
    segment_bytes: int = 0  # their total size
    updated_utc: str = ""
    etag: str = field(default="", compare=False)

    def body(self) -> bytes:
        doc = {k: v for k, v in asdict(self).items() if k != "etag"}
        return json.dumps({"format": HEAD_FORMAT, "version": HEAD_VERSION, **doc}, sort_keys=True).encode()


def parse_head(raw: bytes, etag: str, where: str) -> Head:
    """The head in ``raw``; FormatError naming ``where`` otherwise."""
    if len(raw) > MAX_HEAD_BYTES:
        raise LimitError(f"{where}: head object of {len(raw)} bytes exceeds {MAX_HEAD_BYTES}")
    doc = parse_json(raw, where)
    if not isinstance(doc, dict) or doc.get("format") != HEAD_FORMAT or doc.get("version") != HEAD_VERSION:
        raise FormatError(f"{where}: not a version-{HEAD_VERSION} {HEAD_FORMAT} object")
    try:
        head = Head(check_session_id(doc["session_id"], where), int(doc["generation"]), str(doc["owner"]),
                    doc["lease_bundle"], doc["base"], int(doc["base_tokens"]), int(doc["nrec"]),
                    _ref(doc["last"], where), int(doc["count"]), int(doc["segment_bytes"]),
                    str(doc["updated_utc"]), etag)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{where}: head field missing or of the wrong type ({exc})") from None
    for value in (head.lease_bundle, head.base):
        if value is not None and not isinstance(value, str):
            raise FormatError(f"{where}: 'lease_bundle' and 'base' must be keys or null")
    if not 0 <= head.count <= MAX_CHAIN_SEGMENTS or (head.count == 0) != (head.last is None):
        raise LimitError(f"{where}: a chain of {head.count} segments (at most {MAX_CHAIN_SEGMENTS}; "
                         "none exactly when no last one is named)")
    return head


def check_records(records: bytes, entries: Any, start: int, record_bytes: int, path: Any) -> None:
    """Every record against its sidecar entry before it is shipped (FORMAT.md 4.4)."""
    count = len(entries)  # [count] u64
    hashes = record_checksums(memoryview(records)[:count * record_bytes], record_bytes, start)  # [count] u64
    wrong = np.flatnonzero(hashes != np.asarray(entries, dtype="<u8"))  # [m] offsets from ``start``
    if wrong.size:
        i = int(wrong[0])
        raise CorruptionError(f"{path}: record {start + i} hashes {int(hashes[i]):#018x}, the sidecar "
                              f"vouches for {int(entries[i]):#018x}; refusing to ship it")


__all__ = [
    "CUT_SEGMENT_VERSION",
    "HEAD_FORMAT",
    "META_PREFIX_BYTES",
    "MAX_CHAIN_SEGMENTS",
    "MAX_HEAD_BYTES",
    "MAX_SEGMENT_BYTES",
    "PART_NAMES",
    "SEGMENT_VERSION",
    "Head",
    "Segment",
    "SegmentRef",
    "check_records",
    "digest_of",
    "encode_segment",
    "parse_head",
    "parse_segment",
    "segment_prev",
]
