"""The bundle format's constants, limits and manifest frame (FORMAT.md section 6).

Every struct size is asserted at import; every limit is named and checked before anything is
allocated; the manifest frame's JSON is parsed strictly (no NaN, no duplicate keys, bounded
nesting) and validated field by field, never executed.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from kernels.errors import FormatError, LimitError
from sessionstore.sessions import validate_session_id

# --- frame structs (sizes asserted) -----------------------------------------------------------
BUNDLE_MAGIC = b"COLIBNDL"
BUNDLE_END_MAGIC = b"COLIBEND"
BUNDLE_VERSION = 1
MANIFEST_TAG = b"MNFT"
CHUNK_TAG = b"CHNK"
FILE_END_TAG = b"FEND"
TRAILER_TAG = b"TRLR"
PREAMBLE = struct.Struct("<8sII")  # magic, version, flags
MANIFEST_HEAD = struct.Struct("<4sIQ")  # tag, json length, xxh3_64(json)
CHUNK_HEAD = struct.Struct("<4sHBBIIQ")  # tag, file index, codec, reserved, raw, stored, xxh3_64
FILE_END = struct.Struct("<4sHHQ16s")  # tag, file index, reserved, size, xxh3_128 of the file
TRAILER = struct.Struct("<4sIQQ16s8s")  # tag, files, chunks, raw bytes, framing digest, end
assert PREAMBLE.size == 16 and MANIFEST_HEAD.size == 16
assert CHUNK_HEAD.size == 24 and FILE_END.size == 32 and TRAILER.size == 48

CODEC_RAW = 0
CODEC_ZSTD = 1
CODECS = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd"}

# --- named limits (checked before any allocation) ---------------------------------------------
MAX_MANIFEST_BYTES = 1 << 20  # the manifest frame's JSON
MIN_CHUNK_BYTES = 4 << 10
MAX_CHUNK_BYTES = 16 << 20  # raw bytes of one chunk (and so of one decompression)
DEFAULT_CHUNK_BYTES = 4 << 20  # fastest measured: export+import of 186 MB took 161/141/146/177 ms
# with 1/4/8/16 MiB chunks (a 4 MiB chunk stays in cache between its hashes and its write)
MAX_FILES = 8
MAX_FILE_BYTES = 1 << 42  # 4 TiB: far above a 1M-token GLM-5.2 v1 session (~180 GB)
MAX_JSON_DEPTH = 16
MAX_WINDOW_BYTES = 1 << 25  # zstd window a decoder will accept (chunks are single-segment)

# File names a bundle may carry, in their bundle order. Nothing else is ever written.
ALLOWED_FILES = ("manifest.json", "kv.coli_kv", "kv.coli_kv.colisum", "conversation.json", "responses.json")
MAX_CONVERSATION_BYTES = 32 << 20  # the session's rendered conversation (FORMAT.md 5.8)
MAX_RESPONSES_BYTES = 32 << 20  # the session's stored responses (FORMAT.md 5.11; sessions.response_list's bound)
REQUIRED_FILES = ("manifest.json", "kv.coli_kv")

# zstd level used when compressing. Measured (bench/migrate.py): on fp8 rows from the reference
# decoder, levels 1, 3 and 9 reach the same ratio (1.21x beyond layer 0) and level 9 is several
# times slower; negative levels store literals raw and do not shrink fp8 codes at all.
ZSTD_LEVEL = 1

def check_session_id(value: object, where: str) -> str:
    """A session id as the store accepts it (``paths.validate_session_id``: a plain name of
    [A-Za-z0-9._-] starting with a letter or digit; no separator, control character or '..')."""
    try:
        return validate_session_id(value)
    except (FormatError, LimitError) as exc:
        raise FormatError(f"{where}: session id refused: {exc}") from None


@dataclass(frozen=True)
class BundleFile:
    """One file of the bundle: its name (from ALLOWED_FILES) and size. Its whole-file xxh3_128
    travels in the file-end frame after its last chunk (the writer hashes as it streams)."""

    name: str
    size: int

    def n_chunks(self, chunk_bytes: int) -> int:
        return -(-self.size // chunk_bytes)


@dataclass(frozen=True)
class BundleManifest:
    """The manifest frame: what the bundle holds, known before any file byte is read."""

    session_id: str
    session: dict[str, Any]  # the session's manifest.json, parsed
    kv: dict[str, Any]  # version, dtype, nrec, record_bytes, dims{...}
    files: tuple[BundleFile, ...]
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    created_utc: str = ""
    producer: str = "coli-sessionstore"

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def n_chunks(self) -> int:
        return sum(f.n_chunks(self.chunk_bytes) for f in self.files)

    def raw_bundle_bytes(self) -> int:
        """The whole bundle's size when every chunk is stored raw (codec 0): preamble, manifest
        frame, each file's chunk headers, bytes and file-end frame, trailer."""
        framing = PREAMBLE.size + MANIFEST_HEAD.size + len(self.to_json()) + TRAILER.size
        return framing + sum(f.n_chunks(self.chunk_bytes) * CHUNK_HEAD.size + f.size + FILE_END.size
                             for f in self.files)

    def file(self, name: str) -> BundleFile | None:
        return next((f for f in self.files if f.name == name), None)

    def to_json(self) -> bytes:
        doc = {
            "format": "coli-bundle", "version": BUNDLE_VERSION, "session_id": self.session_id,
            "session": self.session, "kv": self.kv, "chunk_bytes": self.chunk_bytes,
            "files": [{"name": f.name, "size": f.size} for f in self.files],
            "created_utc": self.created_utc, "producer": self.producer,
        }
        data = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        if len(data) > MAX_MANIFEST_BYTES:
            raise LimitError(f"bundle manifest is {len(data)} bytes, limit {MAX_MANIFEST_BYTES}")
        validate_manifest_doc(json.loads(data), "bundle manifest")  # refuse what readers refuse
        return data


def _refuse_constant(name: str) -> Any:
    raise FormatError(f"JSON constant {name} is not allowed")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise FormatError(f"duplicate JSON key {key!r}")
        out[key] = value
    return out


def _depth(value: Any, level: int = 0) -> int:
    if level > MAX_JSON_DEPTH:
        return level
    if isinstance(value, dict):
        return max([_depth(v, level + 1) for v in value.values()], default=level + 1)
    if isinstance(value, list):
        return max([_depth(v, level + 1) for v in value], default=level + 1)
    return level


def parse_json(data: bytes, where: str) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate keys, bounded nesting. Data only."""
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates,
                         parse_constant=_refuse_constant)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{where}: not valid JSON: {exc}") from None
    if _depth(doc) > MAX_JSON_DEPTH:
        raise LimitError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH}")
    return doc


def _int(doc: dict[str, Any], key: str, where: str, lo: int, hi: int) -> int:
    value = doc.get(key)
    if type(value) is not int:
        raise FormatError(f"{where}: {key!r} must be an integer, found {value!r}")
    if value < lo:
        raise FormatError(f"{where}: {key!r} = {value}, expected >= {lo}")
    if value > hi:
        raise LimitError(f"{where}: {key!r} = {value} exceeds the limit {hi}")
    return value


def validate_manifest_doc(doc: Any, where: str) -> BundleManifest:
    """Check the manifest frame's JSON field by field; return it typed."""
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: manifest must be a JSON object")
    if doc.get("format") != "coli-bundle":
        raise FormatError(f"{where}: 'format' is {doc.get('format')!r}, expected 'coli-bundle'")
    if doc.get("version") != BUNDLE_VERSION:
        raise FormatError(
            f"{where}: manifest version {doc.get('version')!r}, expected {BUNDLE_VERSION}")
    session_id = check_session_id(doc.get("session_id"), where)
    session, kv = doc.get("session"), doc.get("kv")
    if not isinstance(session, dict) or not isinstance(kv, dict):
        raise FormatError(f"{where}: 'session' and 'kv' must be JSON objects")
    chunk_bytes = _int(doc, "chunk_bytes", where, MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
    raw_files = doc.get("files")
    if not isinstance(raw_files, list) or not 0 < len(raw_files) <= MAX_FILES:
        raise FormatError(f"{where}: 'files' must be a list of 1..{MAX_FILES} entries")
    files: list[BundleFile] = []
    for i, entry in enumerate(raw_files):
        at = f"{where}: files[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"name", "size"}:
            raise FormatError(f"{at}: expected an object with exactly name and size")
        name = entry["name"]
        if name not in ALLOWED_FILES:
            raise FormatError(f"{at}: file name {name!r} is not one of {list(ALLOWED_FILES)}")
        files.append(BundleFile(name, _int(entry, "size", at, 0, MAX_FILE_BYTES)))
    names = [f.name for f in files]
    if names != sorted(set(names), key=ALLOWED_FILES.index):
        raise FormatError(f"{where}: files {names} repeat or are out of order {list(ALLOWED_FILES)}")
    missing = [n for n in REQUIRED_FILES if n not in names]
    if missing:
        raise FormatError(f"{where}: required file(s) {missing} missing")
    if sum(f.size for f in files) > MAX_FILE_BYTES:
        raise LimitError(f"{where}: files total more than {MAX_FILE_BYTES} bytes")
    if files[0].size > MAX_MANIFEST_BYTES:
        raise LimitError(f"{where}: manifest.json of {files[0].size} bytes, limit {MAX_MANIFEST_BYTES}")
    for name, limit in (("conversation.json", MAX_CONVERSATION_BYTES), ("responses.json", MAX_RESPONSES_BYTES)):
        sized = [f for f in files if f.name == name]
        if sized and sized[0].size > limit:
            raise LimitError(f"{where}: {name} of {sized[0].size} bytes, limit {limit}")
    for key in ("created_utc", "producer"):
        if not isinstance(doc.get(key, ""), str):
            raise FormatError(f"{where}: {key!r} must be a string")
    return BundleManifest(session_id, session, kv, tuple(files), chunk_bytes,
                          doc.get("created_utc", ""), doc.get("producer", ""))


@dataclass
class BundleStats:
    """What a writer or reader moved."""

    files: int = 0
    chunks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    zstd_chunks: int = 0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


__all__ = [
    "BUNDLE_MAGIC", "BUNDLE_END_MAGIC", "BUNDLE_VERSION", "MANIFEST_TAG", "CHUNK_TAG", "FILE_END_TAG",
    "TRAILER_TAG", "PREAMBLE", "MANIFEST_HEAD", "CHUNK_HEAD", "FILE_END", "TRAILER", "CODEC_RAW", "CODEC_ZSTD",
    "CODECS",
    "MAX_MANIFEST_BYTES", "MIN_CHUNK_BYTES", "MAX_CHUNK_BYTES", "DEFAULT_CHUNK_BYTES", "MAX_FILES",
    "MAX_FILE_BYTES", "MAX_JSON_DEPTH", "MAX_CONVERSATION_BYTES", "MAX_RESPONSES_BYTES", "MAX_WINDOW_BYTES",
    "ALLOWED_FILES", "REQUIRED_FILES",
    "ZSTD_LEVEL", "BundleFile", "BundleManifest", "BundleStats", "check_session_id", "parse_json",
    "validate_manifest_doc",
]
