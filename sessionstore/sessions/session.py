"""A persistent chat session: its ``.coli_kv`` file, sidecar, manifest, lock and decoder cache.

Life cycle: ``create`` (empty file + manifest, installed atomically) -> resident (writer lock
held, committed rows memory-mapped and handed to the decoder with zero copy, new rows appended
to the SAME file) -> ``suspend()`` (commit, release memory and the lock; disk only) -> resident
again on the next use (``resume``) -> ``close()``.

Exactness by construction: every chunk of input tokens is fed as ``chunk[:-1]`` (one batch)
then ``chunk[-1:]`` (a single-token step), so the logits that pick a token always come from a
single-token step. Resume recomputes the last committed position the same way (a single-token
step over the restored rows, which attention reads bit-identically however they are split into
blocks), so the recomputed logits match the manifest's digest bit for bit, and the pending
token can always be re-derived: sampling depends only on (seed, position, logits). With
``lazy_logits`` that recompute waits for the first turn that samples from those logits (a turn
that feeds tokens never does) whenever the sidecar vouched for every committed record.

Commit = (1) the kv commit, THE commit point, (2) the manifest's dynamic fields on the commit
state page (:mod:`sessionstore.sessions.committer`). On open, when the file's count F differs from
the manifest's M, the session takes F and recomputes the pending token and the digest from
position F-1 (:mod:`sessionstore.sessions.recovery`).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

import numpy as np

from kernels.errors import ColiError, FormatError, ModelMismatchError
from kernels.model.logits import TurnDraw, settings_of
from kernels.model.protocols import Decoder, LatentCache
from kernels.model.sampling import Sampler
from sessionstore.kvfile import Dims, KVWriter, Vouched, open_kv
from sessionstore.log import get_logger
from sessionstore.sessions.committer import Committer
from sessionstore.sessions.durable_text import CommitWatch
from sessionstore.sessions.fence import (
    Fence,
    SessionFencedError,
    fence_of,
    fences,
    read_fence,
    record_fence,
    reopen_fenced,
)
from sessionstore.sessions.manifest import MANIFEST_NAME, Manifest, ModelRef, write_manifest
from sessionstore.sessions.recovery import ResumeTarget, check_resume, verify_last
from sessionstore.sessions.residency_budget import Residency
from sessionstore.sessions.resident_files import ResidentFiles
from sessionstore.sessions.turn_loop import (
    DecodeDriver,
    TurnResult,
    common_prefix,
    feed_chunk,
    recompute_last,
    run_turn,
)

DEFAULT_COMMIT_EVERY = 64
WRITE_BEHIND = True  # default: decoded records (and their sidecar entries) go to the file as they
# are handed over, write-back started: a commit finds the bytes on disk and waits only for the barriers
APPEND_RUN = 8  # decoded records are handed to the writer 8 at a time (and at every commit): one
# hand-over per token cost ~0.7 ms of per-token work that a batched decode step cannot share

log = get_logger("session")


class SessionHome(Protocol):
    """What a session needs of its store (a :class:`SessionStore` is one): its paths and
    manifest, the creation of its files, forks, and the residency budget it reports to."""

    @property
    def residency(self) -> Residency[Session]: ...
    def session_dir(self, session_id: str) -> Path: ...
    def read_manifest(self, session_id: str) -> Manifest: ...
    def install_empty(self, session_id: str, model_ref: ModelRef, dims: Dims, *, kv_dtype: str = "fp8",
                      sampler: Sampler | None = None) -> Manifest: ...
    def fork(self, source_id: str, new_id: str, *, at: int | None = None) -> Any: ...
    def note_session(self, manifest: Manifest, *, resident: bool) -> None: ...


class CommitRunner(Protocol):
    """Runs the rest of a turn's commit (:meth:`Session.begin_commit`'s callable), now or beside
    the next batched step; ``overlap``: the turn's loop may run on before it has returned."""

    def __call__(self, commit: Callable[[], object], *, overlap: bool = False) -> None: ...


class Session:
    """One session. Obtain through :class:`SessionStore` (``create`` / ``open``)."""

    def __init__(self, store: SessionHome, session_id: str, model: Decoder[Any], model_ref: ModelRef,
                 manifest: Manifest, *, commit_every: int | None = DEFAULT_COMMIT_EVERY,
                 backend: str = "cpu", durability: Any = None, manifest_fsync: bool = False,
                 verify: bool = True, write_behind: bool = WRITE_BEHIND, lazy_logits: bool = False,
                 commit_runner: CommitRunner | None = None, decode_driver: DecodeDriver | None = None,
                 durable_stream: bool = False) -> None:
        self.store = store
        self.residency = store.residency  # where this session reports itself resident / used / released
        self.id = session_id
        self.model = model
        self.model_ref = model_ref
        self.manifest = manifest
        self.commit_every = commit_every
        self.backend = backend
        self.durability = durability
        self.manifest_fsync = manifest_fsync
        self.verify = verify
        self.write_behind = write_behind  # the writer's mode from the next resume on
        self.lazy_logits = lazy_logits  # defer the last position's recompute until its logits are used
        # runs generate's commits every commit_every tokens, now or before the next token is fed (a
        # server commits sessions that are due in the same step together: service.steps.group_commit)
        self.commit_runner = commit_runner
        # runs generate's sampling loops (a server's engine thread, between its batched steps); None: inline
        self.decode_driver = decode_driver
        # durable streaming (:mod:`sessionstore.sessions.durable_text`): generate commits at every
        # token, the state page fdatasync'ed; ``commit_watch`` (set by a turn that holds its text)
        # hears what each commit covers once it has returned
        self.durable_stream = durable_stream
        self.commit_watch: CommitWatch | None = None
        self._in_flight = False  # a durable-stream commit handed to the runner has not returned yet
        self._uncatalogued = 0  # durable-stream commits since the catalogue's row was last rewritten
        self.fence: Fence | None = None  # set when a commit failed with an I/O error (sessions.fence)
        self._deferred = False  # resumed with that recompute still to do (recovery.verify_last)
        self.directory = store.session_dir(session_id)
        self.kv_path = self.directory / manifest.kv_file
        self.state = "suspended"
        self.pending: list[int] = list(manifest.pending)
        self.resume_report: dict[str, Any] = {}
        self._files = ResidentFiles(session_id, self.kv_path)  # writer, mapping, cache: while resident
        self._committer = Committer(session_id, self.directory / MANIFEST_NAME, self.kv_path)
        self._guard: Any = None  # a LeaseKeeper while the object-store tier keeps this host's lease
        self.suspend_timing: dict[str, float] = {}  # the last suspend: commit + release

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, store: SessionHome, session_id: str, model: Decoder[Any], model_ref: ModelRef, *,
               kv_dtype: str = "fp8", sampler: Sampler | None = None, **options: Any) -> Session:
        """A new, empty session: the store installs its files (FORMAT.md 5.1); returned resident."""
        dims = Dims(*model.dims_for_file())
        manifest = store.install_empty(session_id, model_ref, dims, kv_dtype=kv_dtype,
                                       sampler=sampler or Sampler())
        log.info("session.create", id=session_id, model=model_ref.name, kv_dtype=kv_dtype)
        session = cls(store, session_id, model, model_ref, manifest, **options)
        session.resume()
        return session

    @classmethod
    def open(cls, store: SessionHome, session_id: str, model: Decoder[Any], model_ref: ModelRef,
             **options: Any) -> Session:
        manifest = store.read_manifest(session_id)
        session = cls(store, session_id, model, model_ref, manifest, **options)
        session.resume()
        return session

    # ---- state -----------------------------------------------------------------------------
    @property
    def dims(self) -> Dims:
        return Dims(**self.manifest.dims)

    @property
    def cache(self) -> LatentCache | None:
        """The decoder cache over the mapped rows (None unless resident)."""
        return self._files.cache

    @property
    def committed(self) -> int:
        writer = self._files.writer
        return writer.nrec if writer is not None else self.manifest.committed

    @property
    def commit_timing(self) -> dict[str, float]:
        """The last commit: kv commit, state wait, state write (seconds)."""
        return self._committer.timing

    @property
    def length(self) -> int:
        return self.cache.length if self.cache is not None else self.manifest.committed

    def history(self) -> list[int]:
        """Every token of the conversation: the records' input tokens, then the pending ones."""
        if self.cache is not None:
            tokens = [int(t) for t in self.cache.tokens]
        else:
            with open_kv(self.kv_path) as reader:
                tokens = [int(t) for t in reader.tokens[:self.manifest.committed]]
        return tokens + list(self.pending)

    def memory_bytes(self) -> int:
        """Resident footprint: mapped committed bytes + the cache's own rows (0 when suspended)."""
        return self._files.memory_bytes() if self.state == "resident" else 0

    # ---- resume ----------------------------------------------------------------------------
    def ensure_resident(self) -> None:
        if self.fence is not None:
            raise SessionFencedError(self.fence)
        if self.state == "closed":
            raise ColiError(f"session {self.id!r} is closed")
        if self.state != "resident":
            self.resume()

    def resume(self) -> dict[str, Any]:
        """Take the lock, recover to the last commit, map the rows, verify; returns a report."""
        if self.state == "resident":
            return self.resume_report
        t0 = time.perf_counter()
        verified = read_fence(self.directory)  # fenced by a failed commit: from its verified records only
        if verified is not None:
            fenced = self.store.read_manifest(self.id)
            reopen_fenced(self.directory, self.directory / fenced.kv_file, Dims(**fenced.dims), fenced.kv_dtype,
                          verified)
        self.manifest = manifest = self.store.read_manifest(self.id)
        writer = self._open_writer(manifest)
        for _ in range(2):  # read the manifest again under the lock: it is the truth on disk
            manifest = self.store.read_manifest(self.id)
            if (manifest.dims, manifest.kv_dtype) == (self.manifest.dims, self.manifest.kv_dtype):
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
            self._release()
            raise
        report = check.report
        report.update(ready_s=ready - t0, resume_s=time.perf_counter() - t0, committed=self._files.live_cache.length)
        self.resume_report = report
        self.store.note_session(self.manifest, resident=True)  # the catalogue (FORMAT.md 5.9)
        self.residency.register(self)
        self.residency.enforce_budget(keep=self)
        log.info("session.resume", id=self.id, **{k: v for k, v in report.items() if k != "detail"})
        return report

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

    # ---- generation ------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int] | None = None, max_new: int = 16, *,
                 stop_at_eos: bool = False, sampler: Sampler | TurnDraw | None = None, keep_sampler: bool = True,
                 on_token: Callable[[int, int], None] | None = None) -> TurnResult:
        """One turn. With ``prompt_ids`` the longest common prefix of the history is reused (the
        rest truncated) and the remainder fed; without, generation continues where it stopped.
        ``sampler``: this turn's settings (None: the manifest's), or a :class:`TurnDraw` over them;
        with ``keep_sampler`` the settings are stored in the manifest for the turns after it,
        without they serve this turn only."""
        t0 = time.perf_counter()
        self.ensure_resident()
        self.residency.touch(self)
        if sampler is not None and keep_sampler and settings_of(sampler) != self.manifest.sampler:
            changed = dataclasses.replace(self.manifest, sampler=settings_of(sampler))
            write_manifest(self.directory / MANIFEST_NAME, changed)  # durable: rare; a failed one changes nothing
            self.manifest = changed
        turn_sampler = self.manifest.sampler if sampler is None else sampler
        result = TurnResult()
        feed: list[int] | None
        if prompt_ids is not None:
            prompt = self.model.check_tokens(np.asarray(prompt_ids, dtype=np.int64))  # [m] i32, no Python list
            if not prompt.size:
                raise FormatError("the prompt is empty")
            k = common_prefix(self._files.live_cache.tokens, prompt)
            if k < self._files.live_cache.length:
                self.truncate(k)
            result.reused_prefix = k
            feed = [int(t) for t in prompt[k:]]
        else:
            feed = list(self.pending) if self.pending else None
            if feed is None and self._committer.logits is None and self._files.live_cache.length:
                self._note_logits(self._last_logits())
        result.fed = len(feed) if feed else 0
        commits_before = self._committer.commits

        def on_step(token: int, position: int, logits: np.ndarray) -> None:
            self.pending = [token]
            self._note_logits(logits)
            if on_token is not None:
                on_token(token, position)
            every, writer = self.commit_every, self._files.live_writer
            if self.durable_stream:  # every token (its text is held until then), unless one is in flight:
                if not self._in_flight:  # the next one covers this token too
                    self._uncatalogued += 1  # the catalogue's row every commit_every of these (FORMAT.md 5.9)
                    self._commit_through_runner(catalogue=self._uncatalogued >= (every or 1))
            elif every and self._files.live_cache.length - writer.nrec >= every:
                self._commit_through_runner()

        tokens, logits, eos = run_turn(self.model, self._files.live_cache, feed, self._committer.logits, max_new,
                                       turn_sampler, stop_at_eos=stop_at_eos,
                                       on_rows=self._append_in_runs, on_step=on_step, drive=self.decode_driver)
        if not tokens:
            self.pending = []
        self._note_logits(logits)
        assert not self._in_flight  # a turn is woken only once its commits returned
        self._commit_through_runner()
        result.tokens, result.stopped_at_eos = tokens, eos
        result.committed = self._files.live_writer.nrec
        result.commits = self._committer.commits - commits_before
        result.seconds = time.perf_counter() - t0
        self.residency.touch(self)
        return result

    def commit(self) -> int:
        """kv commit (the commit point), then the manifest's dynamic fields; returns the count
        (:class:`sessionstore.sessions.committer.Committer`)."""
        return self.begin_commit()()

    def begin_commit(self, *, catalogue: bool = True) -> Callable[[], int]:
        """The commit's first part, now: the rows not handed to the writer yet are handed over
        and what the commit covers is fixed (the records appended so far, the pending token).
        The returned callable is the rest (the kv commit, then the manifest's dynamic fields;
        returns the count): it reads neither the cache nor ``pending``, so it may run while the
        cache grows (a server runs it beside its next batched step). Nothing may append to the
        writer or commit this session again until it has returned. ``catalogue`` False: the
        store's catalogue row is left to a later commit (a durable stream's per-token ones)."""
        if self.state != "resident":
            committed = self.manifest.committed
            return lambda: committed
        if self.fence is not None:
            raise SessionFencedError(self.fence)
        if self._guard is not None:
            self._guard.check()  # LockedError once another host owns the session
        self._files.append_rows()  # the rows not handed to the writer yet (decode appends in runs)
        writer = self._files.live_writer
        n = writer.length  # what the commit makes durable (checked against the cache there)
        length, pending = self._files.live_cache.length, list(self.pending)
        noted = self._committer.noted()  # the last position's logits: the next token may note others meanwhile
        watch = self.commit_watch
        mark = watch.mark() if watch is not None else 0  # the text this commit covers (durable stream)

        def finish() -> int:
            before = self.manifest
            try:
                self.manifest = self._committer.commit(writer, self.manifest, pending, length, noted=noted,
                                                       durable=self.manifest_fsync or self.durable_stream)
            except OSError as exc:
                if not fences(exc):
                    raise
                self._fence(exc, writer.nrec)
            if self.manifest is not before and catalogue:  # the catalogue's row follows (FORMAT.md 5.9)
                self._uncatalogued = 0
                self.store.note_session(self.manifest, resident=True)
            if watch is not None:  # returned: the text of the tokens it covers may go out
                watch.committed(mark)
            return n

        return finish

    def _fence(self, exc: OSError, verified: int) -> NoReturn:
        """A commit failed with an I/O error: nothing more is written for this session; it is
        reopened from its ``verified`` records only (:mod:`sessionstore.sessions.fence`)."""
        self.fence = fence_of(self.id, verified, exc)
        log.error("session.fenced", id=self.id, verified=verified, error=self.fence.error, message=str(exc))
        record_fence(self.directory, self.fence)  # a later process cuts it back the same way first
        raise SessionFencedError(self.fence) from exc

    def _commit_through_runner(self, *, catalogue: bool = True) -> None:
        """A turn's commit: its first part here, the rest by ``commit_runner`` when there is one
        (a server's engine runs it beside its next batched step, or lets the turn run it without
        holding the other sessions back), else here."""
        finish = self.begin_commit(catalogue=catalogue)
        if self.commit_runner is None:
            finish()
        elif not self.durable_stream:
            self.commit_runner(finish)
        else:  # the loop runs on while it is in flight (no rows handed over, no commit begun meanwhile)
            def finish_then_clear() -> int:
                try:
                    return finish()
                finally:
                    self._in_flight = False

            self._in_flight = True
            self.commit_runner(finish_then_clear, overlap=True)

    def _append_in_runs(self) -> None:
        """After a forward: hand the new rows to the writer once APPEND_RUN of them wait (a prefill
        at once; decode steps in runs, and every commit hands over the rest first). Rows not yet
        handed over are only uncommitted ones, which a crash loses either way."""
        if self._in_flight:  # a commit is writing from the writer: the rows wait for the next one
            return
        if self._files.live_cache.length - self._files.live_writer.length >= APPEND_RUN:
            self._files.append_rows()

    def _note_logits(self, logits: np.ndarray | None) -> None:
        """The logits of the last appended position, digested now (hot in cache)."""
        if logits is not None:
            self._deferred = False  # a later position: the deferred check has nothing left to check
        self._committer.note_logits(logits, 0 if logits is None else self._files.live_cache.length)

    def append_tokens(self, tokens: Sequence[int], *, commit: bool | None = None) -> np.ndarray:
        """Feed ``tokens`` as records without sampling (prompt ingestion); returns the last logits.

        The pending token is dropped (these tokens replace it). ``commit``: True commits now,
        False never, None follows the commit policy.
        """
        self.ensure_resident()
        toks = [int(t) for t in self.model.check_tokens(np.asarray(list(tokens), dtype=np.int64))]
        logits = feed_chunk(self.model, self._files.live_cache, toks, self._files.append_rows)
        self.pending = []
        self._note_logits(logits)
        writer = self._files.live_writer
        due = bool(self.commit_every) and writer.length - writer.nrec >= (self.commit_every or 0)
        if commit or (commit is None and due):
            self.commit()
        return logits

    def truncate(self, n: int) -> int:
        """Keep the first ``n`` records (prefix reuse). The manifest's epoch is bumped FIRST."""
        self.ensure_resident()
        n = max(0, min(int(n), self._files.live_cache.length))
        self.commit()  # the manifest must never claim records the file has not committed
        cut = dataclasses.replace(self.manifest, epoch=self.manifest.epoch + 1, committed=n, pending=[],
                                  last_logits=None)
        # a write that fails (ENOSPC: no room for the temp file) changes nothing, here or on disk
        write_manifest(self.directory / MANIFEST_NAME, cut, durable=self.manifest_fsync)
        self.manifest, self.pending = cut, []
        self._note_logits(None)
        self._deferred = False  # the position changes: no digest describes the new last one
        self._files.live_writer.truncate(n)
        self._files.live_cache.truncate(n)
        self.store.note_session(self.manifest, resident=True)
        log.info("session.truncate", id=self.id, committed=n, epoch=self.manifest.epoch)
        return n

    # ---- suspend / close -------------------------------------------------------------------
    def suspend(self) -> None:
        """Commit, then release the cache, the mapping and the writer lock (disk only). A fenced
        session is released without a commit: nothing more is written for it."""
        if self.state != "resident":
            return
        if self.fence is not None:
            self.abandon()
            return
        t0 = time.perf_counter()
        try:
            self.commit()
        finally:
            t1 = time.perf_counter()
            self._release()
        self.suspend_timing = {"commit_s": t1 - t0, "release_s": time.perf_counter() - t1}
        log.info("session.suspend", id=self.id, committed=self.manifest.committed)

    def _release(self) -> None:
        """Release the writer's descriptors and lock now, the cache and the mapping in the
        background (:meth:`ResidentFiles.release`); the session is suspended after it."""
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
        self.residency.unregister(self)

    def guard_with(self, keeper: Any) -> None:
        """Fence this resident session's commits with ``keeper`` (a LeaseKeeper: its
        ``check()`` runs before every commit; ``stop()`` when the session is released)."""
        if self.state != "resident":
            raise ColiError(f"session {self.id!r} is {self.state}: resume it first")
        self._guard = keeper

    def abandon(self) -> None:
        """Drop the session WITHOUT committing, as a crash would (staged records are lost)."""
        if self.state == "resident":
            self._release()
            log.warning("session.abandon", id=self.id, committed=self.manifest.committed)

    def close(self) -> None:
        self.suspend()
        self.state = "closed"

    def fork(self, new_id: str, *, at: int | None = None) -> Any:
        """Commit, then fork this session into ``new_id`` (see :meth:`SessionStore.fork`)."""
        self.commit()
        return self.store.fork(self.id, new_id, at=at)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session({self.id!r}, {self.state}, committed={self.committed}, pending={self.pending})"


__all__ = ["Session", "SessionHome", "DEFAULT_COMMIT_EVERY"]
