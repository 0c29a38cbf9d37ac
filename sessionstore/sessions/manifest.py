"""A session's manifest: a small JSON file, always replaced atomically.

``manifest.json`` holds what the ``.coli_kv`` bytes cannot: the model's fingerprint, the KV dtype,
the committed length the manifest describes, the pending sampled token(s) (sampled but not fed,
so not a record), the sampler settings, a digest of the last logits, timestamps and format
versions. Writes go temp file -> (fsync) -> ``os.replace`` -> (fsync dir): a reader never sees a
torn manifest. Static changes (create, import, sampler change) are durable (fsynced); the dynamic
fields written at each commit are a verified cache of the committed state (see FORMAT.md section 5).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kernels.errors import CorruptionError, FormatError, LimitError, NotFoundError
from sessionstore.sessions.commit_state import apply_state, update_existing_state

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

    def __post_init__(self) -> None:
        """Refuse values the sampler would refuse (one rule: kernels' Sampler validates), so
        a bad setting raises FormatError before anything is written to a manifest."""
        from kernels.model.sampling import Sampler

        Sampler(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)

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
    """xxh3-128 hex of the logits as little-endian f32 (hashed in place: no copy)."""
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(logits, dtype="<f4"))


DIGEST_CHUNK = 1024  # logits per chunk of the two-level top-k search


def make_digest(logits: np.ndarray, position: int, k: int = DIGEST_TOP_K) -> LogitsDigest:
    """Digest of ``logits`` [vocab] f32 computed at ``position`` (O(vocab): no full sort).

    The top k are found in two levels: the maximum of every DIGEST_CHUNK-wide chunk, the k-th
    largest of those maxima t (at least k logits are >= t, so the k-th largest logit is too),
    then an exact selection among the few logits >= t. Ties at the cut are kept and ordered by
    id, exactly as a full sort by (value desc, id asc) would.
    """
    logits = np.ascontiguousarray(logits, dtype="<f4").reshape(-1)  # [vocab] f32
    n = logits.shape[0]
    k = min(k, n)
    if k <= 0:
        return LogitsDigest(int(position), [], [], logits_hash(logits))
    cand = _top_candidates(logits, k)  # [>= k] ids of every logit >= the k-th largest
    top = cand[np.lexsort((cand, -logits[cand]))][:k]  # [k] by value desc, then id asc
    return LogitsDigest(int(position), top.tolist(), logits[top].astype(np.float64).tolist(),
                        logits_hash(logits))


def _top_candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of every logit >= the k-th largest (ties at the cut included), ascending.

    Only the chunks whose maximum reaches the k-th largest chunk maximum are searched: no
    temporary as big as the vocabulary (those cost page faults on every call).
    """
    n = logits.shape[0]
    chunks = -(-n // DIGEST_CHUNK)
    if chunks >= k:
        whole = n // DIGEST_CHUNK * DIGEST_CHUNK
        maxima = np.empty(chunks, dtype=np.float32)  # [chunks] f32
        logits[:whole].reshape(-1, DIGEST_CHUNK).max(axis=1, out=maxima[:whole // DIGEST_CHUNK])
        if whole < n:
            maxima[-1] = logits[whole:].max()
        if not np.isnan(maxima).any():  # NaN: the plain path below decides
            t = np.partition(maxima, chunks - k)[chunks - k]  # k-th largest chunk maximum
            sel = np.flatnonzero(maxima >= t)  # [c] chunks holding every logit >= t
            ids = (sel[:, None] * DIGEST_CHUNK + np.arange(DIGEST_CHUNK)).reshape(-1)  # [c * C]
            ids = ids[ids < n]
            values = logits[ids]  # [m] f32
            near, values = ids[values >= t], values[values >= t]  # [>= k]: holds the top k
            kth = np.partition(values, values.shape[0] - k)[values.shape[0] - k]
            return near[values >= kth]
    part = np.argpartition(logits, n - k)[n - k:]  # [k] ids of the k largest (any order)
    return np.flatnonzero(logits >= logits[part].min())  # [>= k] ids: ties at the cut included


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


def pending_from_json(data: dict, vocab: int, where: str) -> list[int]:
    """The validated ``pending`` field (0..16 token ids in [0, vocab))."""
    pending = _need(data, "pending", list, where)
    if len(pending) > MAX_PENDING:
        raise LimitError(f"{where}: {len(pending)} pending tokens exceed the limit {MAX_PENDING}")
    for t in pending:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < max(vocab, 1):
            raise FormatError(f"{where}: pending token {t!r} outside the vocab")
    return list(pending)


def digest_from_json(data: dict, vocab: int, where: str) -> LogitsDigest | None:
    """The validated ``last_logits`` field (None when null or absent)."""
    raw = data.get("last_logits")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: field 'last_logits' has type {type(raw).__name__}")
    ids = _need(raw, "top_ids", list, where)
    values = _need(raw, "top_values", list, where)
    if not 0 < len(ids) == len(values) <= 64:
        raise FormatError(f"{where}: last_logits holds {len(ids)} ids and {len(values)} values")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
        raise FormatError(f"{where}: last_logits ids outside the vocab")
    if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
        raise FormatError(f"{where}: last_logits values must be finite numbers")
    return LogitsDigest(_int(raw, "position", where), list(ids), [float(v) for v in values],
                        _need(raw, "hash", str, where))


def digest_to_json(digest: LogitsDigest | None) -> dict[str, Any] | None:
    if digest is None:
        return None
    return {"position": digest.position, "top_ids": list(digest.top_ids),
            "top_values": list(digest.top_values), "hash": digest.hash}


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
    pending = pending_from_json(data, dims["vocab"], where)
    s = _need(data, "sampler", dict, where)
    try:
        sampler = SamplerSettings(_float(s, "temperature", where), _int(s, "top_k", where),
                                  _float(s, "top_p", where), _int(s, "seed", where, 0, (1 << 64) - 1))
    except FormatError as exc:
        msg = str(exc)
        raise FormatError(msg if msg.startswith(where) else f"{where}: field 'sampler': {msg}") from None
    digest = digest_from_json(data, dims["vocab"], where)
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
    """Read and validate ``path`` (never follows a symlink; bounded read), with the dynamic
    fields of its commit state page (``<path>.state``) when that page is sound and of the same
    epoch (:mod:`sessionstore.sessions.commit_state`)."""
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
    return apply_state(manifest_from_json(data, path), path)  # the last commit's fields


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    fd = os.open(os.fspath(directory), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(path: str | os.PathLike[str], manifest: Manifest, *, durable: bool = True) -> None:
    """Replace ``path`` atomically: temp file -> fsync -> os.replace -> fsync dir (``durable``).
    A commit state page beside it is first given the same dynamic fields."""
    path = Path(path)
    manifest.updated_at = utc_now()
    data = manifest.encode()
    update_existing_state(path, manifest)  # a state page must never override it with older values
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
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = str(path)  # ENOSPC/EIO name the manifest, not a nameless write
        raise
    if durable:
        fsync_dir(path.parent)


__all__ = [
    "SCHEMA", "SCHEMA_VERSION", "MANIFEST_NAME", "KV_DTYPES", "DIM_NAMES", "ModelRef",
    "SamplerSettings", "LogitsDigest", "Manifest", "make_digest", "logits_hash",
    "manifest_from_json", "read_manifest", "write_manifest", "fsync_dir", "utc_now",
]
