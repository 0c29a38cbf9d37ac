"""Bringing a session back resident, and releasing it (functions over a :class:`Resuming` session; a
:class:`~sessionstore.sessions.session.Session` calls them): the writer lock taken, the manifest re-read under it,
the committed rows mapped and handed to the decoder, the last position checked (now, or with
``lazy_logits`` at the first turn that samples from it: :mod:`sessionstore.sessions.recovery`); and
the release of all of it (the session is then suspended, on disk only). The file work of a resume
runs by the session's :class:`~sessionstore.sessions.session_home.IoRunner` (a server's I/O thread);
joining the store's residency stays on the caller's thread. A new session's files may be made while
its first turn runs (:func:`start_files`): whatever needs the writer waits for them
(:func:`await_files`).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

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
from sessionstore.sessions.session_commits import CommitPath, Committing
from sessionstore.sessions.session_home import IoStarter, run_here
from sessionstore.sessions.turn_loop import recompute_last

log = get_logger("session")

T = TypeVar("T")


class Resuming(Committing, Protocol):
    """The session as resuming and releasing it reads and writes it (a :class:`Session` is one)."""

    residency: Residency[Any]
    model: Decoder[Any]
    model_ref: ModelRef
    resume_report: dict[str, Any]
    commits: CommitPath


def ensure_resident(session: Resuming, *, beside: bool = False, keep_check: bool = False) -> None:
    """Resume ``session`` unless it is resident; refused when it is fenced or closed. A resident
    session whose checksum pass still runs beside its first step is checked first (:func:`await_check`)
    unless the caller holds what it computes until then: ``keep_check`` (a turn's own path, which
    awaits it before anything leaves), or ``beside`` (a request's resume: the pass is started
    beside, :func:`resume`, and the caller's turn awaits it)."""
    if session.commits.fence is not None:
        raise SessionFencedError(session.commits.fence)
    if session.state == "closed":
        raise ColiError(f"session {session.id!r} is closed")
    if session.state != "resident":
        resume(session, beside=beside)
    elif not (beside or keep_check):
        await_check(session)


def await_check(session: Resuming) -> None:
    """The checksum pass a resume started beside (:func:`resume` with ``beside``) waited for (by
    :func:`run_io`: a server's loop steps the others meanwhile) and its result taken; at once when
    there is none. Its failure releases the session (nothing it computed was sampled, sent or
    committed; the decoder cache over the unchecked rows is dropped) and raises the error a serial
    check raises. Every use of a session's rows but its turn's first steps waits here first."""
    files = session.files
    check = files.check
    if check is None:
        return
    t0 = time.perf_counter()
    if not check.done():
        run_io(session, check.wait)
    try:
        found = files.settle_check()
    except BaseException:
        release(session)  # the writer's close waits for nothing more: the pass has ended
        raise
    report = session.resume_report
    report.update(checksums=found.describe() if found is not None else None, check_s=check.seconds,
                  check_wait_s=time.perf_counter() - t0)
    log.info("session.resume", id=session.id, **{k: v for k, v in report.items() if k != "detail"})


def settle_check(session: Resuming) -> bool:
    """:func:`await_check` for a caller on its way out (a turn that failed before it awaited the
    pass): never raises; False when the pass failed (the session is then released)."""
    try:
        await_check(session)
    except Exception as exc:  # released: its next use resumes it again (and is refused again)
        log.info("session.check_failed", id=session.id, error=str(exc))
        return False
    return True


def run_io(session: Committing, fn: Callable[[], T]) -> T:
    """``fn()`` by the session's :class:`~sessionstore.sessions.session_home.IoRunner` (the options'
    ``io_runner``: a server's I/O thread, while its loop steps the other sessions; else here): file
    work on this session's own files, never the store's residency."""
    return (session.options.io_runner or run_here)(fn)


def resume(session: Resuming, *, beside: bool = False) -> dict[str, Any]:
    """Take the lock, recover to the last commit, map the rows, verify; returns a report. The
    file work (:func:`_resume_files`) runs by :func:`run_io`; the session joins the store's
    residency here, on the caller's thread, once it has returned. With ``beside`` (a request's
    resume) the checksum pass may run on a thread of its own while the request's turn takes its
    first steps (``session.files.check``): the caller MUST :func:`await_check` before anything
    computed from the rows is sampled, sent or committed (:mod:`sessionstore.sessions.session_turns`
    does); the report's ``session.resume`` line is logged once the pass has passed."""
    if session.state == "resident":
        return session.resume_report
    report = run_io(session, lambda: _resume_files(session, beside))
    session.residency.register(session)
    session.residency.enforce_budget(keep=session)
    if session.files.check is None:
        log.info("session.resume", id=session.id, **{k: v for k, v in report.items() if k != "detail"})
    return report


def _resume_files(session: Resuming, beside: bool = False) -> dict[str, Any]:
    """The part of :func:`resume` that works on files: the lock, the manifest, the recovery,
    the mapping, the check of the last position (a recompute asks the model, which a server's
    loop computes while this waits), the catalogue's row. Touches this session and its files
    only (the catalogue behind its own lock); a failure releases them again."""
    t0 = time.perf_counter()
    s, store = session, session.store
    verified = read_fence(s.directory)  # fenced by a failed commit: from its verified records only
    if verified is not None:
        fenced = store.read_manifest(s.id)
        reopen_fenced(s.directory, s.directory / fenced.kv_file, Dims(**fenced.dims), fenced.kv_dtype, verified)
        s.manifest = store.read_manifest(s.id)
    # the writer is opened with the manifest last seen (its dims and dtype; the read under the
    # lock below is the truth, and a file replaced meanwhile is opened afresh): one read fewer
    manifest = s.manifest
    writer = _open_writer(s, manifest, beside)
    for _ in range(2):  # read the manifest again under the lock: it is the truth on disk
        manifest = store.read_manifest(s.id)
        if (manifest.dims, manifest.kv_dtype, manifest.committed) == (s.manifest.dims, s.manifest.kv_dtype,
                                                                       s.manifest.committed):
            break
        writer.close(commit=False)  # replaced meanwhile (adopt_dir): open it afresh
        s.manifest = manifest
        writer = _open_writer(s, manifest, beside)
    else:
        writer.close(commit=False)
        raise ColiError(f"session {s.id!r} keeps changing under us; try again")
    s.manifest, s.pending = manifest, list(manifest.pending)
    if manifest.model.fingerprint != s.model_ref.fingerprint:
        writer.close(commit=False)
        raise ModelMismatchError(
            f"session {s.id!r} belongs to model {manifest.model.name!r} "
            f"({manifest.model.fingerprint}), not to {s.model_ref.name!r} "
            f"({s.model_ref.fingerprint})")
    try:
        s.files.map(writer, s.manifest, s.model, s.options.backend)
        s.commits.committer.page.open()  # the commit state page, overwritten in place by every commit
        s.state = "resident"
        ready = time.perf_counter()
        try:  # may recover s.manifest in place
            check = check_resume(_target(s, writer.vouched), verify=s.options.verify, defer=s.options.lazy_logits)
        finally:
            s.pending = list(s.manifest.pending)
        s.commits.note_logits(check.logits)
        s.commits.deferred = check.deferred
    except BaseException:
        release_files(s)  # never registered: the residency is the caller's to touch
        raise
    report = check.report
    report.update(ready_s=ready - t0, resume_s=time.perf_counter() - t0, committed=s.files.live_cache.length)
    s.resume_report = report
    store.note_session(s.manifest, resident=True)  # the catalogue (FORMAT.md 5.9)
    return report


def start_files(session: Resuming, start: IoStarter, sampler: Sampler) -> None:
    """A new session, resident now over an empty decoder cache, its files (kv file, sidecar,
    manifest, state page, catalogue row) made by ``start`` (a server's I/O thread) meanwhile:
    its first turn's prompt is prefilled and its first token drawn while they are made, and
    its first commit waits for them (:func:`await_files`). Nothing is committed before then,
    so a crash at any point of the making loses nothing committed (FORMAT.md 5.1: the
    directory appears whole or not at all)."""
    s = session
    cache = s.model.new_cache(s.manifest.kv_dtype, s.options.backend)
    manifest = s.manifest

    def make() -> tuple[KVWriter, KVReader]:  # on the I/O thread: the session's own files only
        s.store.install_empty(s.id, s.model_ref, Dims(**manifest.dims), kv_dtype=manifest.kv_dtype,
                              sampler=sampler, manifest=manifest)
        writer = _open_writer(s, manifest)
        try:
            reader = writer.take_vouched_reader() or open_kv(s.kv_path, expect=Dims(**manifest.dims))
            s.commits.committer.page.open()
            s.store.note_session(manifest, resident=True)  # the catalogue (FORMAT.md 5.9)
        except BaseException:
            s.commits.committer.page.close()
            writer.close(commit=False)
            raise
        return writer, reader

    s.files.start_empty(cache, start(make))
    s.state = "resident"
    s.resume_report = {"created": True, "committed": 0}
    s.residency.register(s)
    s.residency.enforce_budget(keep=s)


def await_files(session: Resuming) -> None:
    """Wait (by :func:`run_io`: a server's loop steps the others meanwhile) until a new
    session's files are made and attach their writer; at once when they are (or were never
    being made). A failed making releases the session (nothing was committed) and raises."""
    making = session.files.making
    if making is None:
        return
    if not making.done():
        run_io(session, lambda: making.exception())  # waits, raises nothing: ready() raises it below
    try:
        session.files.ready()
    except BaseException:
        log.error("session.create_failed", id=session.id)
        release(session)
        raise


def _target(s: Resuming, vouched: Vouched | None) -> ResumeTarget:
    return ResumeTarget(s.id, s.model, s.files.live_cache, s.files.live_reader, vouched,
                        s.manifest, s.directory, s.kv_path, s.options.manifest_fsync)


def last_logits(session: Resuming) -> np.ndarray:
    """The logits of the last committed position, recomputed (a single-token step). After a
    deferred resume this is the resume's check of that position (FORMAT.md 5.5): a mismatch
    releases the session and raises CorruptionError, as a failed resume does."""
    s = session
    cache = s.files.live_cache
    if not s.commits.deferred:
        return recompute_last(s.model, cache.blocks, cache.tokens, s.manifest.kv_dtype, cache.index_rows())[0]
    try:
        logits, found = verify_last(_target(s, s.files.live_writer.vouched))
    except BaseException:
        release(s)
        raise
    s.commits.deferred = False
    s.resume_report.update(found)
    log.info("session.last_verified", id=s.id, verified=found["verified"], rows_exact=found["rows_exact"])
    return logits


def _open_writer(s: Resuming, manifest: Manifest, beside: bool = False) -> KVWriter:
    return s.files.open_writer(manifest, durability=s.options.durability, write_behind=s.options.write_behind,
                               beside=beside)


def release(session: Resuming) -> None:
    """Release the writer's descriptors and lock now, the cache and the mapping in the
    background (:meth:`ResidentFiles.release`); the session is suspended after it and out of
    the store's residency."""
    release_files(session)
    session.residency.unregister(session)


def release_files(session: Resuming) -> None:
    """:func:`release` but for the residency (what a failed :func:`_resume_files` undoes).
    A new session's files still being made are waited for first (then released like any)."""
    s = session
    making = s.files.making
    if making is not None:
        making.exception()  # waits; a failed making leaves nothing to release
    s.commits.note_logits(None)
    s.commits.deferred = False
    s.commits.stop_guard()  # resume it through RemoteStore.resume again
    s.commits.committer.page.close()
    s.files.release()
    if s.state == "resident":
        s.state = "suspended"
        s.store.note_session(s.manifest, resident=False)


__all__ = ["Resuming", "await_check", "await_files", "ensure_resident", "last_logits", "release", "release_files",
           "resume", "run_io", "settle_check", "start_files"]
