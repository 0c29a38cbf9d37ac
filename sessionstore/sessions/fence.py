"""Fencing a session whose commit failed with an I/O error (FORMAT.md 5.5, "A failed fsync").

A failed ``fsync`` must never be retried as if nothing had happened (PostgreSQL's "fsyncgate"):
the kernel may have dropped the dirty pages it could not write and marked them clean, so a second
``fsync`` reports success for data that never reached the disk, and the page cache may show bytes
the disk does not hold. So a session whose commit failed with such an error is **fenced**: nothing
more is appended, committed or written for it (every later operation raises
:class:`SessionFencedError`), it is released without a commit, and it is reopened only from what
was verifiably committed: the records of its last commit whose every barrier returned
(:attr:`Fence.verified`). :func:`cut_back` puts the kv file's commit word back there (durably)
before the session is opened again, so records a failed commit may have left past it (in the
page cache, or on disk without their barrier) are never used. The fence is also written beside the
session (``fence.json``, best effort: the disk is failing) so that a process that opens it later,
after a restart say, cuts it back the same way first (:func:`reopen_fenced`).

A full disk (ENOSPC, EDQUOT) is not fenced: the write failed before any barrier, nothing
committed changed, and the next commit rewrites every staged record (FORMAT.md 3).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kernels.errors import ColiError, FormatError
from sessionstore.kvfile import Dims, KVWriter, atomic_replace, read_json_bounded, readable_temp, unlink_durably
from sessionstore.log import get_logger
from sessionstore.sessions.manifest import MANIFEST_NAME, read_manifest, write_manifest

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
FENCE_NAME = "fence.json"  # beside a fenced session's files until it is reopened (FORMAT.md 5.1)
MAX_FENCE_BYTES = 8192  # a failed tail commit's fence holds up to MAX_PENDING token ids

log = get_logger("session")


@dataclass(frozen=True)
class Fence:
    """Why and where a session was fenced."""

    session_id: str
    verified: int  # records committed with every barrier returned: what a reopen starts from
    error: str  # the OS error's name, e.g. "EIO"
    at: float  # time.time() of the failure
    # a failed tail commit (a durable stream's state page alone): the tail of the last one that
    # returned, which the reopen puts back on the page (the failed page may be in the page cache)
    pending: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"id": self.session_id, "verified": self.verified, "error": self.error,
                                  "at": self.at}
        if self.pending is not None:
            out["pending"] = list(self.pending)
        return out


class SessionFencedError(ColiError):
    """A session fenced after a failed commit (:class:`Fence`): nothing more is written to it."""

    def __init__(self, fence: Fence) -> None:
        super().__init__(f"session {fence.session_id!r} is fenced: a commit failed with {fence.error}; nothing "
                         f"more is written to it, and it reopens from its last verified commit "
                         f"({fence.verified} records)")
        self.fence = fence


def fences(exc: BaseException) -> bool:
    """Whether a commit that raised ``exc`` fences its session: any OS error but a full disk."""
    return isinstance(exc, OSError) and exc.errno not in DISK_FULL


def fence_of(session_id: str, verified: int, exc: OSError, pending: list[int] | None = None) -> Fence:
    """The fence of a commit that failed with ``exc``; ``pending``: a failed tail commit's."""
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return Fence(session_id, int(verified), name, time.time(), None if pending is None else tuple(pending))


def cut_back(kv_path: str | os.PathLike[str], dims: Dims, kv_dtype: str, verified: int) -> int:
    """Put the kv file's commit word back to ``verified`` records when it counts more (the
    sidecar's count, fsync, the commit word, fsync: FORMAT.md 3's truncate); returns how many
    records were cut. Takes and releases the writer lock."""
    writer = KVWriter.open(kv_path, dims, kv_dtype=kv_dtype, create=False)
    try:
        cut = max(writer.nrec - verified, 0)
        if cut:
            writer.truncate(verified)
        return cut
    finally:
        writer.close(commit=False)


def record_fence(directory: str | os.PathLike[str], fence: Fence) -> bool:
    """Write ``fence.json`` beside the session (temp, fsync, rename, directory fsync); False, and
    logged, when the failing disk refuses it (the process still holds the fence in memory)."""
    data = json.dumps(fence.to_json(), sort_keys=True).encode()
    try:
        atomic_replace(Path(directory) / FENCE_NAME, data, make_temp=readable_temp(".fence-"))
    except OSError as exc:
        log.error("session.fence_unrecorded", id=fence.session_id, error=str(exc))
        return False
    return True


def read_fence(directory: str | os.PathLike[str]) -> int | None:
    """The verified count ``fence.json`` beside a session holds; None when there is none."""
    path = Path(directory) / FENCE_NAME
    try:
        data = read_json_bounded(path, MAX_FENCE_BYTES, what="fence")
    except FileNotFoundError:
        return None
    verified = data.get("verified") if isinstance(data, dict) else None
    if isinstance(verified, bool) or not isinstance(verified, int) or verified < 0:
        raise FormatError(f"{path}: 'verified' must be an integer >= 0, found {verified!r}")
    return verified


def _fence_pending(directory: str | os.PathLike[str]) -> tuple[int, ...] | None:
    """The ``pending`` a ``fence.json`` holds (a failed tail commit's), else None."""
    try:
        data = read_json_bounded(Path(directory) / FENCE_NAME, MAX_FENCE_BYTES, what="fence")
    except (FileNotFoundError, FormatError):
        return None
    pending = data.get("pending") if isinstance(data, dict) else None
    if not isinstance(pending, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in pending):
        return None
    return tuple(pending)


def reopen_fenced(directory: str | os.PathLike[str], kv_path: str | os.PathLike[str], dims: Dims, kv_dtype: str,
                  verified: int, pending: tuple[int, ...] | None = None) -> int:
    """Before a fenced session opens again: its kv file cut back to ``verified`` records
    (:func:`cut_back`); after a failed tail commit (``pending``, else ``fence.json``'s) the state
    page given the tail of the last one that returned (a whole manifest write, durable); then
    ``fence.json`` removed. Returns the records cut."""
    cut = cut_back(kv_path, dims, kv_dtype, verified)
    pending = _fence_pending(directory) if pending is None else pending
    if pending is not None:
        path = Path(directory) / MANIFEST_NAME
        manifest = read_manifest(path)
        if manifest.committed == verified and manifest.pending != list(pending):
            write_manifest(path, dataclasses.replace(manifest, pending=list(pending)))
    unlink_durably(Path(directory) / FENCE_NAME)
    log.warning("session.reopened_fenced", path=str(directory), verified=verified, records_cut=cut)
    return cut


__all__ = ["DISK_FULL", "FENCE_NAME", "Fence", "SessionFencedError", "cut_back", "fence_of", "fences",
           "read_fence", "record_fence", "reopen_fenced"]
