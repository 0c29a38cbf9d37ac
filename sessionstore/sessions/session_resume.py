"""Bringing a session back resident, and releasing it (:class:`SessionResume`, a base of
:class:`~sessionstore.sessions.session.Session`): the writer lock taken, the manifest re-read under it,
the committed rows mapped and handed to the decoder, the last position checked (now, or with
``lazy_logits`` at the first turn that samples from it: :mod:`sessionstore.sessions.recovery`); and
the release of all of it (the session is then suspended, on disk only). The file work of a resume
runs by the session's :class:`~sessionstore.sessions.session_home.IoRunner` (a server's I/O thread);
joining the store's residency stays on the caller's thread. A new session's files may be made while
its first turn runs (:meth:`SessionResume.start_files`): whatever needs the writer waits for them
(:meth:`SessionResume.await_files`).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kernels.errors import ColiError, ModelMismatchError
from kernels.model.protocols import Decoder
from kernels.model.sampling import Sampler
from sessionstore.kvfile import Dims, KVReader, KVWriter, Vouched, open_kv
from sessionstore.log import get_logger
from sessionstore.sessions.fence import (
    SessionFencedError,
    read_fence,
    reopen_fenced,
)
from sessionstore.sessions.manifest import Manifest, ModelRef
from sessionstore.sessions.recovery import ResumeTarget, check_resume, verify_last
from sessionstore.sessions.residency_budget import Residency
from sessionstore.sessions.session_commits import SessionCommits
from sessionstore.sessions.session_home import IoRunner, IoStarter
from sessionstore.sessions.turn_loop import recompute_last

log = get_logger("session")

T = TypeVar("T")


class SessionResume(SessionCommits):
    """Resume and release; the commit path below them (:class:`SessionCommits`)."""

    # what resuming reads of its session, beside the commit path's (set by Session.__init__)
    residency: Residency[Any]
    model: Decoder[Any]
    model_ref: ModelRef
    kv_path: Path
    backend: str
    durability: Any
    verify: bool
    write_behind: bool
    lazy_logits: bool
    resume_report: dict[str, Any]
    io_runner: IoRunner

    def ensure_resident(self) -> None:
        if self.fence is not None:
            raise SessionFencedError(self.fence)
        if self.state == "closed":
            raise ColiError(f"session {self.id!r} is closed")
        if self.state != "resident":
            self.resume()

    def run_io(self, fn: Callable[[], T]) -> T:
        """``fn()`` by the session's :class:`~sessionstore.sessions.session_home.IoRunner` (a
        server's I/O thread, while its loop steps the other sessions; else here): file work on this
        session's own files, never the store's residency."""
        return self.io_runner(fn)

    def resume(self) -> dict[str, Any]:
        """Take the lock, recover to the last commit, map the rows, verify; returns a report. The
        file work (:meth:`_resume_files`) runs by :meth:`run_io`; the session joins the store's
        residency here, on the caller's thread, once it has returned."""
        if self.state == "resident":
            return self.resume_report
        report = self.run_io(self._resume_files)
        self.residency.register(self)
        self.residency.enforce_budget(keep=self)
        log.info("session.resume", id=self.id, **{k: v for k, v in report.items() if k != "detail"})
        return report

    def _resume_files(self) -> dict[str, Any]:
        """The part of :meth:`resume` that works on files: the lock, the manifest, the recovery,
        the mapping, the check of the last position (a recompute asks the model, which a server's
        loop computes while this waits), the catalogue's row. Touches this session and its files
        only (the catalogue behind its own lock); a failure releases them again."""
        t0 = time.perf_counter()
        verified = read_fence(self.directory)  # fenced by a failed commit: from its verified records only
        if verified is not None:
            fenced = self.store.read_manifest(self.id)
            reopen_fenced(self.directory, self.directory / fenced.kv_file, Dims(**fenced.dims), fenced.kv_dtype,
                          verified)
            self.manifest = self.store.read_manifest(self.id)
        # the writer is opened with the manifest last seen (its dims and dtype; the read under the
        # lock below is the truth, and a file replaced meanwhile is opened afresh): one read fewer
        manifest = self.manifest
        writer = self._open_writer(manifest)
        for _ in range(2):  # read the manifest again under the lock: it is the truth on disk
            manifest = self.store.read_manifest(self.id)
            if (manifest.dims, manifest.kv_dtype, manifest.committed) == (self.manifest.dims, self.manifest.kv_dtype,
                                                                           self.manifest.committed):
                break
            writer.close(commit=False)  # replaced meanwhile (adopt_dir): open it afresh
            self.manifest = manifest
            writer = self._open_writer(manifest)
        else:
            writer.close(commit=False)
            raise ColiError(f"session {self.id!r} keeps changing under us; try again")
        self.manifest, self.pending = manifest, list(manifest.pending)
        if manifest.model.fingerprint != self.model_ref.fingerprint:
            writer.close(commit=False)
            raise ModelMismatchError(
                f"session {self.id!r} belongs to model {manifest.model.name!r} "
                f"({manifest.model.fingerprint}), not to {self.model_ref.name!r} "
                f"({self.model_ref.fingerprint})")
        try:
            self._files.map(writer, self.manifest, self.model, self.backend)
            self._committer.page.open()  # the commit state page, overwritten in place by every commit
            self.state = "resident"
            ready = time.perf_counter()
            try:  # may recover self.manifest in place
                check = check_resume(self._target(writer.vouched), verify=self.verify, defer=self.lazy_logits)
            finally:
                self.pending = list(self.manifest.pending)
            self._note_logits(check.logits)
            self._deferred = check.deferred
        except BaseException:
            self._release_files()  # never registered: the residency is the caller's to touch
            raise
        report = check.report
        report.update(ready_s=ready - t0, resume_s=time.perf_counter() - t0, committed=self._files.live_cache.length)
        self.resume_report = report
        self.store.note_session(self.manifest, resident=True)  # the catalogue (FORMAT.md 5.9)
        return report

    def start_files(self, start: IoStarter, sampler: Sampler) -> None:
        """A new session, resident now over an empty decoder cache, its files (kv file, sidecar,
        manifest, state page, catalogue row) made by ``start`` (a server's I/O thread) meanwhile:
        its first turn's prompt is prefilled and its first token drawn while they are made, and
        its first commit waits for them (:meth:`await_files`). Nothing is committed before then,
        so a crash at any point of the making loses nothing committed (FORMAT.md 5.1: the
        directory appears whole or not at all)."""
        cache = self.model.new_cache(self.manifest.kv_dtype, self.backend)
        manifest = self.manifest

        def make() -> tuple[KVWriter, KVReader]:  # on the I/O thread: the session's own files only
            self.store.install_empty(self.id, self.model_ref, Dims(**manifest.dims), kv_dtype=manifest.kv_dtype,
                                     sampler=sampler, manifest=manifest)
            writer = self._open_writer(manifest)
            try:
                reader = writer.take_vouched_reader() or open_kv(self.kv_path, expect=Dims(**manifest.dims))
                self._committer.page.open()
                self.store.note_session(manifest, resident=True)  # the catalogue (FORMAT.md 5.9)
            except BaseException:
                self._committer.page.close()
                writer.close(commit=False)
                raise
            return writer, reader

        self._files.start_empty(cache, start(make))
        self.state = "resident"
        self.resume_report = {"created": True, "committed": 0}
        self.residency.register(self)
        self.residency.enforce_budget(keep=self)

    def await_files(self) -> None:
        """Wait (by :meth:`run_io`: a server's loop steps the others meanwhile) until a new
        session's files are made and attach their writer; at once when they are (or were never
        being made). A failed making releases the session (nothing was committed) and raises."""
        making = self._files.making
        if making is None:
            return
        if not making.done():
            self.run_io(lambda: making.exception())  # waits, raises nothing: ready() raises it below
        try:
            self._files.ready()
        except BaseException:
            log.error("session.create_failed", id=self.id)
            self._release()
            raise

    def _target(self, vouched: Vouched | None) -> ResumeTarget:
        return ResumeTarget(self.id, self.model, self._files.live_cache, self._files.live_reader, vouched,
                            self.manifest, self.directory, self.kv_path, self.manifest_fsync)

    def _last_logits(self) -> np.ndarray:
        """The logits of the last committed position, recomputed (a single-token step). After a
        deferred resume this is the resume's check of that position (FORMAT.md 5.5): a mismatch
        releases the session and raises CorruptionError, as a failed resume does."""
        cache = self._files.live_cache
        if not self._deferred:
            return recompute_last(self.model, cache.blocks, cache.tokens, self.manifest.kv_dtype,
                                  cache.index_rows())[0]
        try:
            logits, found = verify_last(self._target(self._files.live_writer.vouched))
        except BaseException:
            self._release()
            raise
        self._deferred = False
        self.resume_report.update(found)
        log.info("session.last_verified", id=self.id, verified=found["verified"], rows_exact=found["rows_exact"])
        return logits

    def _open_writer(self, manifest: Manifest) -> KVWriter:
        return self._files.open_writer(manifest, durability=self.durability, write_behind=self.write_behind)

    def _release(self) -> None:
        """Release the writer's descriptors and lock now, the cache and the mapping in the
        background (:meth:`ResidentFiles.release`); the session is suspended after it and out of
        the store's residency."""
        self._release_files()
        self.residency.unregister(self)

    def _release_files(self) -> None:
        """:meth:`_release` but for the residency (what a failed :meth:`_resume_files` undoes).
        A new session's files still being made are waited for first (then released like any)."""
        making = self._files.making
        if making is not None:
            making.exception()  # waits; a failed making leaves nothing to release
        self._note_logits(None)
        self._deferred = False
        if self._guard is not None:  # resume it through RemoteStore.resume again
            self._guard.stop()
            self._guard = None
        self._committer.page.close()
        self._files.release()
        if self.state == "resident":
            self.state = "suspended"
            self.store.note_session(self.manifest, resident=False)


__all__ = ["SessionResume"]
