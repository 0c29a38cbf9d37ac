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
page cache, or on disk without their barrier) are never used.

A full disk (ENOSPC, EDQUOT) is not fenced: the write failed before any barrier, nothing
committed changed, and the next commit rewrites every staged record (FORMAT.md 3).
"""
from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass

from kernels.errors import ColiError
from sessionstore.kvfile import Dims, KVWriter

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Fence:
    """Why and where a session was fenced."""

    session_id: str
    verified: int  # records committed with every barrier returned: what a reopen starts from
    error: str  # the OS error's name, e.g. "EIO"
    at: float  # time.time() of the failure

    def to_json(self) -> dict[str, object]:
        return {"id": self.session_id, "verified": self.verified, "error": self.error, "at": self.at}


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


def fence_of(session_id: str, verified: int, exc: OSError) -> Fence:
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return Fence(session_id, int(verified), name, time.time())


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


__all__ = ["DISK_FULL", "Fence", "SessionFencedError", "cut_back", "fence_of", "fences"]
