"""The digest of a session's last logits (FORMAT.md 5.3 ``last_logits``, 5.5 verification).

It stores the top-k ids and their f32 values plus a hash of the whole logits vector. Resume
recomputes that position (a single-token step, the same operation that produced it, so normally
bit-identical: the hash matches); if only the hash differs (another BLAS after a migration), the
top-1 id must match (or be within a near-tie) and every stored value must agree within
``DIGEST_RTOL``/``DIGEST_ATOL``; anything else is a failed resume.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kernels.errors import CorruptionError, FormatError
from sessionstore.sessions.fields import need, need_int

DIGEST_TOP_K = 8
DIGEST_RTOL = 1e-3
DIGEST_ATOL = 1e-4


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
        tied = {int(i) for i, v in zip(ids, stored, strict=True) if stored[0] - v <= tol[0]}
        if top1 not in tied:
            raise CorruptionError(
                f"logits at position {self.position}: top-1 expected id {self.top_ids[0]} "
                f"({stored[0]:.6g}), recomputed id {top1} ({float(logits[top1]):.6g})")
        err = float(np.max(np.abs(found - stored)))
        return False, f"within tolerance (max |diff| {err:.3g} over the top-{ids.size})"


def logits_hash(logits: np.ndarray) -> str:
    """xxh3-128 hex of the logits as little-endian f32 (hashed in place: no copy)."""
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(logits, dtype="<f4").data)


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


def digest_from_json(data: dict, vocab: int, where: str) -> LogitsDigest | None:
    """The validated ``last_logits`` field (None when null or absent)."""
    raw = data.get("last_logits")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: field 'last_logits' has type {type(raw).__name__}")
    ids = need(raw, "top_ids", list, where)
    values = need(raw, "top_values", list, where)
    if not 0 < len(ids) == len(values) <= 64:
        raise FormatError(f"{where}: last_logits holds {len(ids)} ids and {len(values)} values")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
        raise FormatError(f"{where}: last_logits ids outside the vocab")
    if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
        raise FormatError(f"{where}: last_logits values must be finite numbers")
    return LogitsDigest(need_int(raw, "position", where), list(ids), [float(v) for v in values],
                        need(raw, "hash", str, where))


def digest_to_json(digest: LogitsDigest | None) -> dict[str, Any] | None:
    if digest is None:
        return None
    return {"position": digest.position, "top_ids": list(digest.top_ids),
            "top_values": list(digest.top_values), "hash": digest.hash}


__all__ = ["DIGEST_TOP_K", "DIGEST_RTOL", "DIGEST_ATOL", "DIGEST_CHUNK", "LogitsDigest", "logits_hash",
           "make_digest", "digest_from_json", "digest_to_json"]
