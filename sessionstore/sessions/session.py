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
state page (:mod:`sessionstore.sessions.committer`; the session's side: ``session_commits.py``).
In durable-stream mode the commits between kv commits are tail commits, the page alone with every
token after the committed records as ``pending`` (:mod:`sessionstore.sessions.durable_text`), so
``pending`` may hold many tokens: ``history()`` is the records, then ``pending``, and a turn
without a prompt feeds all of it first.
On open, when the file's count F differs from the manifest's M, the session takes F and recomputes
the pending token and the digest from position F-1 (:mod:`sessionstore.sessions.recovery`; the
session's side: ``session_resume.py``). Turns (generate, append_tokens, truncate) are
``session_turns.py``'s; what a session needs of its store, ``session_home.py``'s; the options it runs with
(:class:`~sessionstore.sessions.session_options.SessionOptions`), ``session_options.py``'s.
"""
from __future__ import annotations

import time
from typing import Any

from kernels.errors import ColiError
from kernels.model.protocols import Decoder, LatentCache
from kernels.model.sampling import Sampler
from sessionstore.kvfile import Dims, Durability, open_kv
from sessionstore.log import get_logger
from sessionstore.sessions.committer import Committer
from sessionstore.sessions.durable_text import CommitWatch
from sessionstore.sessions.fence import Fence
from sessionstore.sessions.manifest import MANIFEST_NAME, Manifest, ModelRef, empty_manifest
from sessionstore.sessions.resident_files import ResidentFiles
from sessionstore.sessions.session_home import IoRunner, SessionHome, run_here
from sessionstore.sessions.session_options import DEFAULT_SESSION_OPTIONS, SessionOptions
from sessionstore.sessions.session_turns import SessionTurns

log = get_logger("session")


class Session(SessionTurns):
    """One session. Obtain through :class:`SessionStore` (``create`` / ``open``).

    Its state and life cycle are here (construction, what it reports, suspend, close, fork); each
    phase's work is a base of its own, lowest first: the commit path (:class:`SessionCommits`),
    resume and release (:class:`SessionResume`), turns (:class:`SessionTurns`). Each base declares
    the state it reads, which :meth:`__init__` sets.

    Why 42 methods: 22 are those bases' (each phase a module of its own, split by job already); of
    its own 20, 7 are read-only properties, 2 the constructors (create, open) and 3 the context
    manager and repr; what is left is the life cycle every caller holds one object for (suspend,
    close, abandon, fork, guard). Split further, the halves would share the resident files, the
    committer and the state they change together (resident, suspended, fenced)."""

    def __init__(self, store: SessionHome, session_id: str, model: Decoder[Any], model_ref: ModelRef,
                 manifest: Manifest, options: SessionOptions = DEFAULT_SESSION_OPTIONS) -> None:
        self.store = store
        self.residency = store.residency  # where this session reports itself resident / used / released
        self.id = session_id
        self.model = model
        self.model_ref = model_ref
        self.manifest = manifest
        # the options, each a field of its own (SessionOptions): a server sets commit_runner on a
        # session it adopts, a benchmark turns verify off between phases
        self.commit_every = options.commit_every
        self.backend = options.backend
        self.durability = options.durability
        self.manifest_fsync = options.manifest_fsync
        self.verify = options.verify
        self.write_behind = options.write_behind  # the writer's mode from the next resume on
        self.lazy_logits = options.lazy_logits  # defer the last position's recompute until its logits are used
        # runs generate's commits every commit_every tokens, now or before the next token is fed (a
        # server commits sessions that are due in the same step together: service.steps.group_commit)
        self.commit_runner = options.commit_runner
        # runs generate's sampling loops (a server's engine thread, between its batched steps); None: inline
        self.decode_driver = options.decode_driver
        # runs the file work of its resumes (a server's I/O thread, while its loop steps the others)
        self.io_runner: IoRunner = options.io_runner or run_here
        # durable streaming (:mod:`sessionstore.sessions.durable_text`): generate commits at every
        # token (a tail commit: the state page alone, fdatasync'ed; a kv commit when due);
        # ``commit_watch`` (set by a turn that holds its text) hears what each commit covers once
        # it has returned
        self.durable_stream = options.durable_stream
        self.commit_watch: CommitWatch | None = None
        self._in_flight = False  # a durable-stream commit handed to the runner has not returned yet
        self.fence: Fence | None = None  # set when a commit failed with an I/O error (sessions.fence)
        self._deferred = False  # resumed with that recompute still to do (recovery.verify_last)
        self.directory = store.session_dir(session_id)
        self.kv_path = self.directory / manifest.kv_file
        self.state = "suspended"
        self.pending: list[int] = list(manifest.pending)
        self.resume_report: dict[str, Any] = {}
        self._files = ResidentFiles(session_id, self.kv_path)  # writer, mapping, cache: while resident
        self._committer = Committer(session_id, self.directory / MANIFEST_NAME, self.kv_path,
                                    (options.durability or Durability()).fsync)  # the page's barrier: the seam's
        self._guard: Any = None  # a LeaseKeeper while the object-store tier keeps this host's lease
        self.suspend_timing: dict[str, float] = {}  # the last suspend: commit + release

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, store: SessionHome, session_id: str, model: Decoder[Any], model_ref: ModelRef, *,
               kv_dtype: str = "fp8", sampler: Sampler | None = None,
               options: SessionOptions = DEFAULT_SESSION_OPTIONS) -> Session:
        """A new, empty session: the store installs its files (FORMAT.md 5.1; by the options'
        ``io_runner``, when they give one, as its resume maps them); returned resident. With the
        options' ``io_start`` (and no ``durable_stream``) it is returned resident at once over an
        empty cache, its files made on that I/O thread meanwhile (:meth:`start_files`); its id is
        checked here (:meth:`SessionHome.refuse_taken`)."""
        dims = Dims(*model.dims_for_file())
        sampler = sampler or Sampler()
        log.info("session.create", id=session_id, model=model_ref.name, kv_dtype=kv_dtype,
                 behind=options.io_start is not None and not options.durable_stream)
        if options.io_start is not None and not options.durable_stream:
            store.refuse_taken(session_id)
            session = cls(store, session_id, model, model_ref,
                          empty_manifest(session_id, model_ref, dims, kv_dtype, sampler), options)
            session.start_files(options.io_start, sampler)
            return session
        run_io: IoRunner = options.io_runner or run_here
        manifest = run_io(lambda: store.install_empty(session_id, model_ref, dims, kv_dtype=kv_dtype,
                                                      sampler=sampler))
        session = cls(store, session_id, model, model_ref, manifest, options)
        session.resume()
        return session

    @classmethod
    def open(cls, store: SessionHome, session_id: str, model: Decoder[Any], model_ref: ModelRef,
             options: SessionOptions = DEFAULT_SESSION_OPTIONS, manifest: Manifest | None = None) -> Session:
        """The session, resumed; ``manifest``: the one its caller has just read (read here if None;
        the resume reads it again under the writer's lock, the one it trusts)."""
        manifest = manifest if manifest is not None else store.read_manifest(session_id)
        session = cls(store, session_id, model, model_ref, manifest, options)
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
    def files_pending(self) -> bool:
        """True while a new session's files are being made or not yet attached (:meth:`start_files`):
        nothing of it is on disk to read or remove yet (no conversation file, no records)."""
        return self._files.making is not None

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

    @property
    def guard(self) -> Any:
        """The LeaseKeeper fencing this resident session's commits (:meth:`guard_with`), or None."""
        return self._guard

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


__all__ = ["Session"]
