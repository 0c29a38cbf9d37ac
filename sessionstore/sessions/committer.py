"""The two-step commit of a resident session (FORMAT.md 5.5) and the logits it digests.

Commit = (1) the kv commit (records + sidecar entries, fsync, commit word, fsync): THE commit
point; then (2) the manifest's dynamic fields (``committed``, ``pending``, ``last_logits``,
``updated_at``) written in place to the commit state page (``manifest.json.state``, see
:mod:`sessionstore.sessions.commit_state_page`); (2) never starts before (1) returned. The new page is
encoded on a helper thread while (1) waits in its data barrier; only its 4 KiB ``pwrite``
follows the commit point. A durable stream's tail commit (:meth:`Committer.commit_tail`) is (2)
alone, made durable, with the tokens after the committed records as ``pending``.

A tail commit's only barrier is the fdatasync of its state page, so it can be split there
(:class:`BarrierCommit`: write, barrier, settle) and the tail commits of several sessions that a
server starts together can share ONE barrier (:func:`commit_together`): every page written, one
``syncfs`` of the file system that holds them (every dirty page and inode of it written and the
disk's cache flushed: at least what each page's fdatasync makes durable), then each commit settled.
One barrier per engine step instead of one per session per step; measured in ``bench.durable_stream``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kernels.errors import CorruptionError
from sessionstore.kvfile import Durability, KVWriter
from sessionstore.log import get_logger
from sessionstore.sessions.commit_state_page import StateWriter
from sessionstore.sessions.digest import LogitsDigest, make_digest
from sessionstore.sessions.manifest import Manifest, utc_now

log = get_logger("session")


def manifest_after_commit(manifest: Manifest, n: int, pending: list[int], logits: np.ndarray | None,
                          noted: LogitsDigest | None) -> Manifest | None:
    """The manifest after a commit of ``n`` records (step 2), a new object; None if unchanged.
    ``logits`` [vocab] f32 are those of the last appended position and ``noted`` their digest
    taken when they were produced (used when it describes position n-1)."""
    digest = manifest.last_logits
    if logits is not None and n and (digest is None or digest.position != n - 1
                                     or manifest.committed != n):
        digest = noted
        if digest is None or digest.position != n - 1:
            digest = make_digest(logits, n - 1)
    if (n, pending, digest) == (manifest.committed, manifest.pending, manifest.last_logits):
        return None
    return dataclasses.replace(manifest, committed=n, pending=list(pending), last_logits=digest)


class Committer:
    """Commits one session's appended records (its state page kept open while it is resident)
    and holds the logits of its last appended position, digested as they were produced."""

    def __init__(self, session_id: str, manifest_path: Path, kv_path: Path,
                 sync: Callable[[int], None] = os.fdatasync) -> None:
        self.session_id = session_id
        self.kv_path = kv_path
        self.page = StateWriter(manifest_path, sync)  # per-commit fields, in place; ``sync``: its barrier
        self.barrier = sync  # the page's barrier (called with its descriptor)
        self._share: Hashable | None = _UNKNOWN  # share_key(), found on first use
        self.logits: np.ndarray | None = None  # [vocab] f32 of the last appended position
        self.digest: LogitsDigest | None = None  # their digest, when already taken (else at the commit)
        self.commits = 0  # commits that changed the manifest's dynamic fields
        self.timing: dict[str, float] = {}  # the last commit: kv commit, state wait, state write

    def note_logits(self, logits: np.ndarray | None, length: int) -> None:
        """Keep the logits of position ``length - 1``; the commit that records them digests them.
        (Digesting every token's logits while hot, ~85 us for a 155k vocabulary, cost more than
        digesting only the committed one cold, 3-5x that, once every ``commit_every`` tokens; and
        per-token work is what a batched decode step cannot share.)"""
        self.logits = logits
        self.digest = None

    def noted(self) -> tuple[np.ndarray | None, LogitsDigest | None]:
        """The logits noted last and their digest (taken by a commit when it begins)."""
        return self.logits, self.digest

    def commit(self, writer: KVWriter, manifest: Manifest, pending: list[int], length: int, *,
               durable: bool = False,
               noted: tuple[np.ndarray | None, LogitsDigest | None] | None = None) -> Manifest:
        """Commit the ``length`` records appended through ``writer``: the kv commit, then the
        state page (fdatasync'ed when ``durable``); returns the manifest after it. ``noted``: the
        logits of position ``length - 1`` and their digest as :meth:`noted` gave them when the
        commit began (default: those noted now)."""
        t0 = time.perf_counter()
        n = writer.length
        if n != length:
            raise CorruptionError(f"{self.kv_path}: {n} records appended, the cache holds {length}")
        logits, digest = self.noted() if noted is None else noted
        prepared: list[tuple[Manifest, bytes] | None] = []
        committed = writer.commit(beside=lambda: prepared.append(self._prepare(manifest, pending, n, logits, digest)))
        t1 = time.perf_counter()
        state = prepared[0] if prepared else self._prepare(manifest, pending, n, logits, digest)
        t2 = time.perf_counter()
        if committed != n:
            raise CorruptionError(f"{self.kv_path}: committed {committed} records, expected {n}")
        if state is not None:  # the dynamic fields: one page overwritten in place (no rename)
            new, page = state
            self.page.write_page(page, durable=durable)
            manifest = new
            self.commits += 1
            log.info("session.commit", id=self.session_id, committed=n, pending=pending)
        self.timing = {"kv_commit_s": t1 - t0, "state_wait_s": t2 - t1,
                       "state_write_s": time.perf_counter() - t2}
        return manifest

    def commit_tail(self, manifest: Manifest, tail: list[int]) -> Manifest:
        """A durable stream's tail commit (:mod:`sessionstore.sessions.durable_text`): the state
        page alone, ``committed`` and ``last_logits`` those of the last kv commit (``manifest``'s),
        ``pending`` = ``tail`` (every token after the committed records); one ``pwrite`` and one
        fdatasync. Returns the manifest after it."""
        new = self.write_tail(manifest, tail)
        self.page.sync()
        return new

    def write_tail(self, manifest: Manifest, tail: list[int]) -> Manifest:
        """:meth:`commit_tail` up to its barrier: the page written, not yet durable (its barrier
        is :meth:`StateWriter.sync`, or one shared by several sessions: :func:`commit_together`)."""
        t0 = time.perf_counter()
        new = object.__new__(type(manifest))  # copy.copy without its reduce protocol (~5x the cost)
        new.__dict__.update(manifest.__dict__)  # (dataclasses.replace re-runs __init__: ~10x)
        new.pending, new.updated_at = list(tail), utc_now()
        self.page.write_page(self.page.encode(new), durable=False)
        self.commits += 1
        self.timing = {"kv_commit_s": 0.0, "state_wait_s": 0.0, "state_write_s": time.perf_counter() - t0}
        return new

    def share_key(self) -> Hashable | None:
        """What a barrier shared with other sessions' pages must cover (:class:`BarrierCommit`):
        the file system of the state page; None when this session's barrier is a seam of its own
        (a test's faults, a recorder) or there is no ``syncfs``: then it syncs alone."""
        if self._share is _UNKNOWN:
            real = _is_real_fsync(self.barrier)
            self._share = os.fstat(self.page.fd).st_dev if real and _syncfs is not None else None
        return self._share if Durability.fsync is _REAL_FSYNC else None

    def _prepare(self, manifest: Manifest, pending: list[int], n: int, logits: np.ndarray | None,
                 digest: LogitsDigest | None) -> tuple[Manifest, bytes] | None:
        """The manifest after a commit of ``n`` records and its state page; None if unchanged."""
        new = manifest_after_commit(manifest, n, pending, logits, digest)
        if new is None:
            return None
        new.updated_at = utc_now()
        return new, self.page.encode(new)


class BarrierCommit:
    """A commit whose one barrier is the fdatasync of one file, split there: ``write`` does its
    writes and returns that file's descriptor, ``sync`` is its own barrier, ``settle`` runs after
    the barrier returned (``None``: returns the count) or after the writes or the barrier failed
    (the error: raises it, or what it became, e.g. a fence). Called, it runs the three alone;
    :func:`commit_together` runs several under one barrier when their ``share`` keys are equal
    (None: never shared)."""

    def __init__(self, write: Callable[[], int], sync: Callable[[int], None],
                 settle: Callable[[BaseException | None], int], share: Hashable | None) -> None:
        self.write, self.sync, self.settle, self.share = write, sync, settle, share

    def __call__(self) -> int:
        try:
            self.sync(self.write())
        except BaseException as exc:  # settled with it: the fence, or the error re-raised
            return self.settle(exc)
        return self.settle(None)

    def then(self, after: Callable[[], None]) -> BarrierCommit:
        """The same commit with ``after()`` run once it has settled (returned or raised)."""
        settle = self.settle

        def settle_then(error: BaseException | None) -> int:
            try:
                return settle(error)
            finally:
                after()

        return BarrierCommit(self.write, self.sync, settle_then, self.share)


def commit_together(commits: Sequence[BarrierCommit]) -> list[BaseException | None]:
    """Several sessions' commits under ONE barrier (their ``share`` keys equal and not None):
    every commit's writes, then one ``syncfs`` of the file system that holds their files, then
    each commit settled (its text released), in order. A failed write fails only its commit; a
    failed barrier fails them all (it cannot tell whose page did not reach the disk). Returns each
    commit's error (None: it returned)."""
    keys = {c.share for c in commits}
    if None in keys or len(keys) != 1:
        raise ValueError("commit_together: the commits do not share one file system's barrier")
    fds: list[int | None] = []
    errors: list[BaseException | None] = []
    for commit in commits:
        try:
            fds.append(commit.write())
            errors.append(None)
        except BaseException as exc:  # this commit fails alone
            fds.append(None)
            errors.append(exc)
    written = [fd for fd in fds if fd is not None]
    if written:
        try:
            syncfs(written[0])
        except OSError as exc:
            errors = [err if err is not None else exc for err in errors]
    out: list[BaseException | None] = []
    for commit, err in zip(commits, errors, strict=True):
        try:
            commit.settle(err)
            out.append(None)
        except BaseException as exc:  # handed to the commit's owner (its turn re-raises it)
            out.append(exc)
    return out


def syncfs(fd: int) -> None:
    """``syncfs(2)``: every dirty page and inode of the file system holding ``fd`` written, and the
    disk's write cache flushed; OSError when it fails. Used on Linux 5.8 and later only: before, it
    returned 0 even when writeback failed (an EIO would go unseen; then every page syncs alone)."""
    if _syncfs is None:
        raise OSError(38, "syncfs is not available here")
    if _syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def syncfs_available() -> bool:
    """Whether :func:`syncfs` can run here (Linux's libc has it)."""
    return _syncfs is not None


def _load_syncfs() -> Any:  # the libc function, or None
    if not sys.platform.startswith("linux") or _kernel() < (5, 8):  # before 5.8 it hid writeback errors
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _kernel() -> tuple[int, int]:
    """The running Linux kernel's (major, minor); (0, 0) when it cannot be read."""
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return 0, 0


def _is_real_fsync(sync: Callable[[int], None]) -> bool:
    """``sync`` is the real barrier (``os.fdatasync``, or a plain :class:`Durability`'s ``fsync``):
    a shared barrier does at least what it does. A seam of a test (faults, a recorder) is not."""
    if sync is os.fdatasync:
        return True
    owner = getattr(sync, "__self__", None)
    return type(owner) is Durability and getattr(sync, "__func__", None) is _REAL_FSYNC


_syncfs = _load_syncfs()
_REAL_FSYNC = Durability.fsync  # a test that patches the class's fsync turns sharing off
_UNKNOWN: Any = object()


__all__ = ["BarrierCommit", "Committer", "commit_together", "manifest_after_commit", "syncfs", "syncfs_available"]
