"""A session's manifest: a small JSON file, always replaced atomically.

``manifest.json`` holds what the ``.coli_kv`` bytes cannot: the model's fingerprint, the KV dtype,
the committed length the manifest describes, the pending sampled token(s) (sampled but not fed,
so not a record), the sampler settings, a digest of the last logits, timestamps and format
versions. Writes go temp file -> (fsync) -> ``os.replace`` -> (fsync dir): a reader never sees a
torn manifest. Static changes (create, import, sampler change) are durable (fsynced); the dynamic
fields written at each commit are a verified cache of the committed state (see FORMAT.md section 5).

The last-logits digest (:mod:`sessionstore.sessions.digest`) and the commit state page
(:mod:`sessionstore.sessions.commit_state_page`) are their own modules; this one reads the page back
into a manifest (:func:`apply_state`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernels.errors import FormatError, LimitError, NotFoundError
from kernels.jsonfile import parse_json_bytes
from kernels.model.sampling import Sampler
from kernels.rows import KV_DTYPES, KV_FORMAT_OF_DTYPE, KV_VERSION_OF_DTYPE
from sessionstore.kvfile import Dims, atomic_replace, open_regular, readable_temp
from sessionstore.log import get_logger
from sessionstore.sessions.commit_state_page import (
    newest_state,
    put_back_state,
    read_state_page,
    state_path,
    update_existing_state,
)
from sessionstore.sessions.digest import (
    LogitsDigest,
    digest_from_json,
    digest_to_json,
)
from sessionstore.sessions.fields import need, need_float, need_int, pending_from_json

SCHEMA = "coli-session-manifest"
SCHEMA_VERSION = 1
SIDECAR_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20
log = get_logger("session")

DIM_NAMES = ("n_layers", "kv_lora", "qk_rope", "index_head_dim", "n_index_layers", "vocab")


def utc_now() -> str:
    """ISO-8601 UTC timestamp with microseconds."""
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


@dataclass(frozen=True)
class ModelRef:
    """Which model a session belongs to: a display name, how to load it, and its fingerprint."""

    name: str
    path: str  # a checkpoint directory (absolute) or "tiny"
    fingerprint: str


@dataclass
class Manifest:
    """Everything about a session that is not in its ``.coli_kv`` bytes."""

    id: str
    model: ModelRef
    kv_dtype: str
    dims: dict[str, int]
    committed: int = 0
    epoch: int = 0  # bumped by every truncate: the committed prefix is immutable within an epoch
    pending: list[int] = field(default_factory=list)
    sampler: Sampler = field(default_factory=Sampler)
    last_logits: LogitsDigest | None = None
    origin: str = "created"
    created_at: str = field(default_factory=utc_now)
    updated_at: str = field(default_factory=utc_now)
    kv_file: str = "kv.coli_kv"

    @property
    def kv_version(self) -> int:
        return KV_VERSION_OF_DTYPE[self.kv_dtype]

    @property
    def kv_tag(self) -> int:
        """The ``.coli_kv`` format tag of this session's rows (v3: the codec)."""
        return KV_FORMAT_OF_DTYPE[self.kv_dtype][1]

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "id": self.id,
                "model": {"name": self.model.name, "path": self.model.path,
                          "fingerprint": self.model.fingerprint},
                "kv_dtype": self.kv_dtype, "dims": dict(self.dims), "committed": self.committed,
                "epoch": self.epoch, "pending": list(self.pending),
                "sampler": {"temperature": self.sampler.temperature, "top_k": self.sampler.top_k,
                            "top_p": self.sampler.top_p, "seed": self.sampler.seed},
                "last_logits": digest_to_json(self.last_logits),
                "origin": self.origin, "created_at": self.created_at,
                "updated_at": self.updated_at, "kv_file": self.kv_file,
                "formats": {"manifest": SCHEMA_VERSION, "coli_kv": self.kv_version,
                            "sidecar": SIDECAR_FORMAT_VERSION}}

    def encode(self) -> bytes:
        """Compact JSON (sorted keys, one line): the C encoder, a few microseconds."""
        return (json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True,
                           allow_nan=False) + "\n").encode()


def empty_manifest(session_id: str, model_ref: ModelRef, dims: Dims, kv_dtype: str, sampler: Sampler) -> Manifest:
    """The manifest of a new, empty session of ``dims``: no records yet."""
    return Manifest(id=session_id, model=model_ref, kv_dtype=kv_dtype,
                    dims={k: int(v) for k, v in asdict(dims).items()}, sampler=sampler)


def manifest_from_json(data: Any, where: str) -> Manifest:
    """Validate a decoded manifest; raise FormatError naming the file and field."""
    if not isinstance(data, dict):
        raise FormatError(f"{where}: not a JSON object")
    if data.get("schema") != SCHEMA:
        raise FormatError(f"{where}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    version = need_int(data, "schema_version", where)
    if version != SCHEMA_VERSION:
        raise FormatError(f"{where}: schema_version {version} not supported (this reads {SCHEMA_VERSION})")
    m = need(data, "model", dict, where)
    model = ModelRef(need(m, "name", str, where), need(m, "path", str, where),
                     need(m, "fingerprint", str, where))
    kv_dtype = need(data, "kv_dtype", str, where)
    if kv_dtype not in KV_DTYPES:
        raise FormatError(f"{where}: kv_dtype {kv_dtype!r}, expected one of {KV_DTYPES}")
    d = need(data, "dims", dict, where)
    dims = {name: need_int(d, name, where) for name in DIM_NAMES}
    pending = pending_from_json(data, dims["vocab"], where)
    s = need(data, "sampler", dict, where)
    try:
        sampler = Sampler(need_float(s, "temperature", where), need_int(s, "top_k", where),
                                  need_float(s, "top_p", where), need_int(s, "seed", where, 0, (1 << 64) - 1))
    except FormatError as exc:
        msg = str(exc)
        raise FormatError(msg if msg.startswith(where) else f"{where}: field 'sampler': {msg}") from None
    digest = digest_from_json(data, dims["vocab"], where)
    kv_file = need(data, "kv_file", str, where)
    if kv_file != "kv.coli_kv":
        raise FormatError(f"{where}: kv_file {kv_file!r}, expected 'kv.coli_kv'")
    return Manifest(
        id=need(data, "id", str, where), model=model, kv_dtype=kv_dtype, dims=dims,
        committed=need_int(data, "committed", where), epoch=need_int(data, "epoch", where, 0, (1 << 63) - 1),
        pending=list(pending), sampler=sampler, last_logits=digest,
        origin=need(data, "origin", str, where), created_at=need(data, "created_at", str, where),
        updated_at=need(data, "updated_at", str, where), kv_file=kv_file)


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``path`` (never follows a symlink; bounded read), with the dynamic
    fields of its commit state page (``<path>.state``) when that page is sound and of the same
    epoch (:mod:`sessionstore.sessions.commit_state_page`)."""
    path = os.fspath(path)
    try:
        fd = open_regular(path, os.O_RDONLY | os.O_NONBLOCK, what="manifest")
    except FileNotFoundError:
        raise NotFoundError(f"{path}: no manifest") from None
    except OSError as exc:
        raise FormatError(f"{path}: cannot open the manifest ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_size > MAX_MANIFEST_BYTES:
            raise LimitError(f"{path}: manifest of {st.st_size} bytes exceeds {MAX_MANIFEST_BYTES}")
        raw = os.pread(fd, MAX_MANIFEST_BYTES + 1, 0)
    finally:
        os.close(fd)
    data = parse_json_bytes(raw, path, "manifest")
    return apply_state(manifest_from_json(data, path), path)  # the last commit's fields


def apply_state(manifest: Manifest, manifest_path: str | os.PathLike[str]) -> Manifest:
    """``manifest`` with the dynamic fields of its state page when that page is sound and of
    the same epoch; otherwise ``manifest`` itself (the older, valid values)."""
    try:
        page = read_state_page(manifest_path)
        if page is None:
            return manifest
        state = newest_state(page, manifest.dims["vocab"], str(state_path(manifest_path)), manifest.epoch)
    except FormatError:  # no sound slot of this epoch: torn by a concurrent write, or damaged, or
        return manifest  # written before a truncate, or a truncate's manifest not yet in place
    return dataclasses.replace(manifest, committed=state["committed"], pending=state["pending"],
                               last_logits=state["last_logits"], updated_at=state["updated_at"])


def write_manifest(path: str | os.PathLike[str], manifest: Manifest, *, durable: bool = True) -> None:
    """Replace ``path`` atomically: temp file -> fsync -> os.replace -> fsync dir (``durable``).
    A commit state page beside it is first given the same dynamic fields; should the replace fail
    before its rename (a full disk has no room for the temp file), the page gets its previous
    bytes back, so readers keep seeing the last commit (FORMAT.md 5.3.1), and the error is raised."""
    path = Path(path)
    manifest.updated_at = utc_now()
    data = manifest.encode()
    before = update_existing_state(path, manifest)  # a state page must never override it with older values
    try:
        atomic_replace(path, data, make_temp=readable_temp(".manifest-"), durable=durable)
    except BaseException:
        if before is not None and not _holds(path, data):  # not renamed: the old manifest is in place
            _put_back_page(path, before)
        raise


def _holds(path: Path, data: bytes) -> bool:
    """True when the file at ``path`` is exactly ``data`` (read as :func:`read_manifest` reads)."""
    try:
        fd = open_regular(path, os.O_RDONLY | os.O_NONBLOCK, what="manifest")
    except OSError:
        return False
    try:
        return os.pread(fd, len(data) + 1, 0) == data
    finally:
        os.close(fd)


def _put_back_page(path: Path, before: bytes) -> None:
    """Best effort (the disk is failing): a page left with the new fields is ignored by readers
    when the epochs differ, and recovery (FORMAT.md 5.5) rewrites it on the next open."""
    try:
        put_back_state(path, before)
    except OSError as exc:
        log.warning("manifest.state_not_put_back", path=str(path), error=str(exc))


__all__ = [
    "SCHEMA", "SCHEMA_VERSION", "MANIFEST_NAME", "DIM_NAMES", "ModelRef", "Manifest", "manifest_from_json",
    "empty_manifest", "apply_state", "read_manifest", "write_manifest", "utc_now",
]
