"""The two-step commit of a resident session (FORMAT.md 5.5) and the logits it digests.

Commit = (1) the kv commit (records + sidecar entries, fsync, commit word, fsync): THE commit
point; then (2) the manifest's dynamic fields (``committed``, ``pending``, ``last_logits``,
``updated_at``) written in place to the commit state page (``manifest.json.state``, see
:mod:`sessionstore.sessions.commit_state_page`); (2) never starts before (1) returned. The new page is
encoded on a helper thread while (1) waits in its data barrier; only its 4 KiB ``pwrite``
follows the commit point. A durable stream's tail commit (:meth:`Committer.commit_tail`) is (2)
alone, made durable, with the tokens after the committed records as ``pending``.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kernels.errors import CorruptionError
from sessionstore.kvfile import KVWriter
from sessionstore.log import get_logger
from sessionstore.sessions.commit_state_page import StateWriter, encode_state
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
        t0 = time.perf_counter()
        new = dataclasses.replace(manifest, pending=list(tail), updated_at=utc_now())
        self.page.write_page(encode_state(new, self.page.seq), durable=True)
        self.commits += 1
        self.timing = {"kv_commit_s": 0.0, "state_wait_s": 0.0, "state_write_s": time.perf_counter() - t0}
        return new

    def _prepare(self, manifest: Manifest, pending: list[int], n: int, logits: np.ndarray | None,
                 digest: LogitsDigest | None) -> tuple[Manifest, bytes] | None:
        """The manifest after a commit of ``n`` records and its state page; None if unchanged."""
        new = manifest_after_commit(manifest, n, pending, logits, digest)
        if new is None:
            return None
        new.updated_at = utc_now()
        return new, encode_state(new, self.page.seq)


__all__ = ["Committer", "manifest_after_commit"]
