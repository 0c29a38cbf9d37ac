"""A session's manifest: a small JSON file, always replaced atomically.

``manifest.json`` holds what the ``.coli_kv`` bytes cannot: the model's fingerprint, the KV dtype,
the committed length the manifest describes, the pending sampled token(s) (sampled but not fed,
so not a record), the sampler settings, a digest of the last logits, timestamps and format
versions. Writes go temp file -> (fsync) -> ``os.replace`` -> (fsync dir): a reader never sees a
torn manifest. Static changes (create, import, sampler change) are durable (fsynced); the dynamic
fields written at each commit are a verified cache of the committed state (see FORMAT.d/50).

The last-logits digest stores the top-k ids and their f32 values plus a hash of the whole logits
vector. Resume recomputes that position (a single-token step, the same operation that produced
it, so normally bit-identical: the hash matches); if only the hash differs (another BLAS after a
migration), the top-1 id must match (or be within a near-tie) and every stored value must agree
within ``DIGEST_RTOL``/``DIGEST_ATOL``; anything else is a failed resume.
"""
from __future__ import annotations

import json
import math
import os
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kernels.errors import CorruptionError, FormatError, LimitError, NotFoundError

SCHEMA = "coli-session-manifest"
SCHEMA_VERSION = 1
SIDECAR_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20
MAX_PENDING = 16
DIGEST_TOP_K = 8
DIGEST_RTOL = 1e-3
DIGEST_ATOL = 1e-4
KV_DTYPES = ("fp8", "f32")
KV_VERSION_OF_DTYPE = {"f32": 1, "fp8": 2}
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


@dataclass(frozen=True)
class SamplerSettings:
    """Counter-based sampler settings; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class LogitsDigest:
    """Digest of the logits at ``position`` (the last committed record)."""

    position: int
    top_ids: list[int]
    top_values: list[float]
    hash: str  # xxh3_128 hex of the logits as little-endian f32

    def check(self, logits: np.ndarray) -> tuple[bool, str]:
        """Compare with recomputed logits [vocab] f32 -> (exact, detail); raise on a mismatch."""
        logits = np.ascontiguousarray(logits, dtype="<f4")  # [vocab] f32
        if logits_hash(logits) == self.hash:
            return True, "bit-identical"
        ids = np.asarray(self.top_ids, dtype=np.int64)  # [k]
        if ids.size == 0 or int(ids.max()) >= logits.shape[0]:
            raise CorruptionError(f"digest of position {self.position} names ids outside the vocab")
        stored = np.asarray(self.top_values, dtype=np.float64)  # [k]
        found = logits[ids].astype(np.float64)  # [k]
        tol = DIGEST_ATOL + DIGEST_RTOL * np.maximum(np.abs(stored), 1.0)  # [k]
        worst = int(np.argmax(np.abs(found - stored) - tol))
        if np.any(np.abs(found - stored) > tol):
            raise CorruptionError(
                f"logits at position {self.position}: id {int(ids[worst])} expected "
                f"{stored[worst]:.6g}, recomputed {found[worst]:.6g} (tolerance {tol[worst]:.2g})")
        top1 = int(np.argmax(logits))
        # near-tie: any stored id within tolerance of the stored top-1 may legitimately win
        tied = {int(i) for i, v in zip(ids, stored) if stored[0] - v <= tol[0]}
        if top1 not in tied:
            raise CorruptionError(
                f"logits at position {self.position}: top-1 expected id {self.top_ids[0]} "
                f"({stored[0]:.6g}), recomputed id {top1} ({float(logits[top1]):.6g})")
        err = float(np.max(np.abs(found - stored)))
        return False, f"within tolerance (max |diff| {err:.3g} over the top-{ids.size})"


def logits_hash(logits: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(logits, dtype="<f4").tobytes())


def make_digest(logits: np.ndarray, position: int, k: int = DIGEST_TOP_K) -> LogitsDigest:
    """Digest of ``logits`` [vocab] f32 computed at ``position`` (O(vocab): no full sort)."""
    logits = np.ascontiguousarray(logits, dtype="<f4").reshape(-1)  # [vocab] f32
    n = logits.shape[0]
    k = min(k, n)
    part = np.argpartition(logits, n - k)[n - k:]  # [k] ids of the k largest (any order)
    cand = np.flatnonzero(logits >= logits[part].min())  # [>= k] ids: ties at the cut included
    top = cand[np.lexsort((cand, -logits[cand]))][:k]  # [k] by value desc, then id asc
    return LogitsDigest(int(position), top.tolist(), logits[top].astype(np.float64).tolist(),
                        logits_hash(logits))


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
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    last_logits: LogitsDigest | None = None
    origin: str = "created"
    created_at: str = field(default_factory=utc_now)
    updated_at: str = field(default_factory=utc_now)
    kv_file: str = "kv.coli_kv"

    @property
    def kv_version(self) -> int:
        return KV_VERSION_OF_DTYPE[self.kv_dtype]

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **body,
                "formats": {"manifest": SCHEMA_VERSION, "coli_kv": self.kv_version,
                            "sidecar": SIDECAR_FORMAT_VERSION}}

    def encode(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def _need(obj: dict, key: str, kind: type | tuple, where: str) -> Any:
    if key not in obj:
        raise FormatError(f"{where}: field {key!r} is missing")
    value = obj[key]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise FormatError(f"{where}: field {key!r} has type {type(value).__name__}")
    return value


def _int(obj: dict, key: str, where: str, lo: int = 0, hi: int = (1 << 31) - 1) -> int:
    value = _need(obj, key, int, where)
    if not lo <= value <= hi:
        raise FormatError(f"{where}: field {key!r} = {value} outside [{lo}, {hi}]")
    return value


def _float(obj: dict, key: str, where: str) -> float:
    value = float(_need(obj, key, (int, float), where))
    if not math.isfinite(value):
        raise FormatError(f"{where}: field {key!r} is not finite")
    return value


def manifest_from_json(data: Any, where: str) -> Manifest:
    """Validate a decoded manifest; raise FormatError naming the file and field."""
    if not isinstance(data, dict):
        raise FormatError(f"{where}: not a JSON object")
    if data.get("schema") != SCHEMA:
        raise FormatError(f"{where}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    version = _int(data, "schema_version", where)
    if version != SCHEMA_VERSION:
        raise FormatError(f"{where}: schema_version {version} not supported (this reads {SCHEMA_VERSION})")
    m = _need(data, "model", dict, where)
    model = ModelRef(_need(m, "name", str, where), _need(m, "path", str, where),
                     _need(m, "fingerprint", str, where))
    kv_dtype = _need(data, "kv_dtype", str, where)
    if kv_dtype not in KV_DTYPES:
        raise FormatError(f"{where}: kv_dtype {kv_dtype!r}, expected one of {KV_DTYPES}")
    d = _need(data, "dims", dict, where)
    dims = {name: _int(d, name, where) for name in DIM_NAMES}
    pending = _need(data, "pending", list, where)
    if len(pending) > MAX_PENDING:
        raise LimitError(f"{where}: {len(pending)} pending tokens exceed the limit {MAX_PENDING}")
    for t in pending:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < max(dims["vocab"], 1):
            raise FormatError(f"{where}: pending token {t!r} outside the vocab")
    s = _need(data, "sampler", dict, where)
    sampler = SamplerSettings(_float(s, "temperature", where), _int(s, "top_k", where),
                              _float(s, "top_p", where), _int(s, "seed", where, 0, (1 << 64) - 1))
    digest = None
    raw = data.get("last_logits")
    if raw is not None:
        if not isinstance(raw, dict):
            raise FormatError(f"{where}: field 'last_logits' has type {type(raw).__name__}")
        ids = _need(raw, "top_ids", list, where)
        values = _need(raw, "top_values", list, where)
        if not 0 < len(ids) == len(values) <= 64:
            raise FormatError(f"{where}: last_logits holds {len(ids)} ids and {len(values)} values")
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < dims["vocab"] for i in ids):
            raise FormatError(f"{where}: last_logits ids outside the vocab")
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
            raise FormatError(f"{where}: last_logits values must be finite numbers")
        digest = LogitsDigest(_int(raw, "position", where), list(ids), [float(v) for v in values],
                              _need(raw, "hash", str, where))
    kv_file = _need(data, "kv_file", str, where)
    if kv_file != "kv.coli_kv":
        raise FormatError(f"{where}: kv_file {kv_file!r}, expected 'kv.coli_kv'")
    return Manifest(
        id=_need(data, "id", str, where), model=model, kv_dtype=kv_dtype, dims=dims,
        committed=_int(data, "committed", where), epoch=_int(data, "epoch", where, 0, (1 << 63) - 1),
        pending=list(pending), sampler=sampler, last_logits=digest,
        origin=_need(data, "origin", str, where), created_at=_need(data, "created_at", str, where),
        updated_at=_need(data, "updated_at", str, where), kv_file=kv_file)


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``path`` (never follows a symlink; bounded read)."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NotFoundError(f"{path}: no manifest") from None
    except OSError as exc:
        raise FormatError(f"{path}: cannot open the manifest ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: manifest is not a regular file")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise LimitError(f"{path}: manifest of {st.st_size} bytes exceeds {MAX_MANIFEST_BYTES}")
        raw = os.pread(fd, MAX_MANIFEST_BYTES + 1, 0)
    finally:
        os.close(fd)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path}: manifest is not valid JSON ({exc})") from None
    return manifest_from_json(data, path)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    fd = os.open(os.fspath(directory), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(path: str | os.PathLike[str], manifest: Manifest, *, durable: bool = True) -> None:
    """Replace ``path`` atomically: temp file -> fsync -> os.replace -> fsync dir (``durable``)."""
    path = Path(path)
    manifest.updated_at = utc_now()
    data = manifest.encode()
    fd, tmp = tempfile.mkstemp(prefix=".manifest-", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; a manifest is as readable as its kv file
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


__all__ = [
    "SCHEMA", "SCHEMA_VERSION", "MANIFEST_NAME", "KV_DTYPES", "DIM_NAMES", "ModelRef",
    "SamplerSettings", "LogitsDigest", "Manifest", "make_digest", "logits_hash",
    "manifest_from_json", "read_manifest", "write_manifest", "fsync_dir", "utc_now",
]
