"""A persistent chat session: its ``.coli_kv`` file, sidecar, manifest, lock and decoder cache.

Life cycle: ``create`` (empty file + manifest, installed atomically) -> resident (writer lock
held, committed rows memory-mapped and handed to the decoder with zero copy, new rows appended
to the SAME file) -> ``suspend()`` (commit, release memory and the lock; disk only) -> resident
again on the next use (``ensure_resident()``, a resume) -> ``close()``.

Exactness by construction: a chunk of input tokens is fed in one forward, which computes every
position as a single-token step of that token computes it, so the logits that pick a token are
always a single-token step's. Resume recomputes the last committed position the same way (a single-token
step over the restored rows, which attention reads bit-identically however they are split into
blocks), so the recomputed logits match the manifest's digest bit for bit, and the pending
token can always be re-derived: sampling depends only on (seed, position, logits). With
``lazy_logits`` that recompute waits for the first turn that samples from those logits (a turn
that feeds tokens never does) whenever the sidecar vouched for every committed record.

Commit = (1) the kv commit, THE commit point, (2) the manifest's dynamic fields on the commit
state page (:mod:`sessionstore.sessions.committer`; the session's side: its :class:`CommitPath`,
``session_commits.py``).
In durable-stream mode the commits between kv commits are tail commits, the page alone with every
token after the committed records as ``pending`` (:mod:`sessionstore.sessions.durable_text`), so
``pending`` may hold many tokens: ``history()`` is the records, then ``pending``, and a turn
without a prompt feeds all of it first.
On open, when the file's count F differs from the manifest's M, the session takes F and recomputes
the pending token and the digest from position F-1 (:mod:`sessionstore.sessions.recovery`; the
session's side: ``session_resume.py``'s functions). Turns (generate, append_tokens, truncate) are
``session_turns.py``'s functions over a session; what a session needs of its store, ``session_home.py``'s;
the options it runs with (:class:`~sessionstore.sessions.session_options.SessionOptions`, read in place),
``session_options.py``'s.

Composition, not a mixin chain (as LevelDB's DBImpl holds its VersionSet, log writer and memtable): a
:class:`Session` keeps its state and life cycle and holds its files (``files``, a
:class:`~sessionstore.sessions.resident_files.ResidentFiles`), its commit path (``commits``, a
:class:`~sessionstore.sessions.session_commits.CommitPath`: the committer, its guard and fence) and its
options (``options``).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

import sessionstore.sessions.session_resume as residence
import sessionstore.sessions.session_turns as turns
from kernels.model.logits import TurnDraw
from kernels.model.protocols import Decoder, LatentCache
from kernels.model.sampling import Sampler
from sessionstore.kvfile import Dims, open_kv
from sessionstore.log import get_logger
from sessionstore.sessions.durable_text import CommitWatch
from sessionstore.sessions.manifest import Manifest, ModelRef, empty_manifest
from sessionstore.sessions.output import TurnReply
from sessionstore.sessions.residency_budget import Residency
from sessionstore.sessions.resident_files import ResidentFiles
from sessionstore.sessions.session_commits import CommitPath
from sessionstore.sessions.session_home import IoRunner, SessionHome, run_here
from sessionstore.sessions.session_options import DEFAULT_SESSION_OPTIONS, SessionOptions

log = get_logger("session")

T = TypeVar("T")



class Session:
    """One session. Obtain through :class:`SessionStore` (``create`` / ``open``).

    It keeps its state (``manifest``, ``state``, ``pending``) and its life cycle (construction,
    resume, suspend, close, fork) and holds what does the work: its files (``files``), its commit
    path (``commits``: the committer, the guard and the fence) and its options (``options``, read in
    place; replace them whole with :func:`dataclasses.replace`). Resume and release are
    :mod:`~sessionstore.sessions.session_resume`'s functions, the turns
    :mod:`~sessionstore.sessions.session_turns`'; the methods here are the calls its users make."""

    def __init__(self, store: SessionHome, session_id: str, model: Decoder[Any], model_ref: ModelRef,
                 manifest: Manifest, options: SessionOptions = DEFAULT_SESSION_OPTIONS) -> None:
        self.store = store
        self.residency: Residency[Any] = store.residency  # where it reports itself resident / used / released
        self.id = session_id
        self.model = model
        self.model_ref = model_ref
        self.manifest = manifest
        self.options = options  # how it runs (a server's commit runner, decode driver and I/O threads)
        # durable streaming (:mod:`sessionstore.sessions.durable_text`): ``commit_watch`` (set by a
        # turn that holds its text) hears what each commit covers once it has returned
        self.commit_watch: CommitWatch | None = None
        self.directory = store.session_dir(session_id)
        self.kv_path = self.directory / manifest.kv_file
        self.state = "suspended"
        self.pending: list[int] = list(manifest.pending)
        self.resume_report: dict[str, Any] = {}
        self.suspend_timing: dict[str, float] = {}  # the last suspend: commit + release
        self.files = ResidentFiles(session_id, self.kv_path)  # writer, mapping, cache: while resident
        self.commits = CommitPath(self)  # the committer, its guard and fence (reads the fields above)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, store: SessionHome, session_id: str, model: Decoder[Any], model_ref: ModelRef, *,
               kv_dtype: str = "fp8", sampler: Sampler | None = None,
               options: SessionOptions = DEFAULT_SESSION_OPTIONS) -> Session:
        """A new, empty session: the store installs its files (FORMAT.md 5.1; by the options'
        ``io_runner``, when they give one, as its resume maps them); returned resident. With the
        options' ``io_start`` (and no ``durable_stream``) it is returned resident at once over an
        empty cache, its files made on that I/O thread meanwhile
        (:func:`~sessionstore.sessions.session_resume.start_files`); its id is checked here
        (:meth:`SessionHome.refuse_taken`)."""
        dims = Dims(*model.dims_for_file())
        sampler = sampler or Sampler()
        log.info("session.create", id=session_id, model=model_ref.name, kv_dtype=kv_dtype,
                 behind=options.io_start is not None and not options.durable_stream)
        if options.io_start is not None and not options.durable_stream:
            store.refuse_taken(session_id)
            session = cls(store, session_id, model, model_ref,
                          empty_manifest(session_id, model_ref, dims, kv_dtype, sampler), options)
            residence.start_files(session, options.io_start, sampler)
            return session
        run_io: IoRunner = options.io_runner or run_here
        manifest = run_io(lambda: store.install_empty(session_id, model_ref, dims, kv_dtype=kv_dtype,
                                                      sampler=sampler))
        session = cls(store, session_id, model, model_ref, manifest, options)
        residence.resume(session)
        return session

    @classmethod
    def open(cls, store: SessionHome, session_id: str, model: Decoder[Any], model_ref: ModelRef,
             options: SessionOptions = DEFAULT_SESSION_OPTIONS, manifest: Manifest | None = None, *,
             beside: bool = False) -> Session:
        """The session, resumed; ``manifest``: the one its caller has just read (read here if None;
        the resume reads it again under the writer's lock, the one it trusts); ``beside``: its
        checksum pass beside the caller's turn (:func:`~sessionstore.sessions.session_resume.resume`)."""
        manifest = manifest if manifest is not None else store.read_manifest(session_id)
        session = cls(store, session_id, model, model_ref, manifest, options)
        residence.resume(session, beside=beside)
        return session

    # ---- state -----------------------------------------------------------------------------
    @property
    def cache(self) -> LatentCache | None:
        """The decoder cache over the mapped rows (None unless resident)."""
        return self.files.cache

    @property
    def committed(self) -> int:
        writer = self.files.writer
        return writer.nrec if writer is not None else self.manifest.committed

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
        return self.files.memory_bytes() if self.state == "resident" else 0

    # ---- resume / suspend / close ------------------------------------------------------------
    def ensure_resident(self, *, beside: bool = False, keep_check: bool = False) -> None:
        """Resident again unless it is: the lock taken, recovered to the last commit, the rows
        mapped, the last position verified, its report in ``resume_report``
        (:func:`~sessionstore.sessions.session_resume.resume`); refused when fenced
        (SessionFencedError) or closed. A checksum pass still running beside a turn's first step
        is awaited first, unless ``keep_check`` or ``beside``
        (:func:`~sessionstore.sessions.session_resume.ensure_resident`)."""
        residence.ensure_resident(self, beside=beside, keep_check=keep_check)

    def run_io(self, fn: Callable[[], T]) -> T:
        """``fn()`` by the options' ``io_runner`` (a server's I/O thread; else here): file work on
        this session's own files, never the store's residency."""
        return residence.run_io(self, fn)

    def await_files(self) -> None:
        """A new session's files made and its writer attached (waited for by :meth:`run_io`); at
        once when they are. A failed making releases the session and raises."""
        residence.await_files(self)

    def suspend(self) -> None:
        """Commit, then release the cache, the mapping and the writer lock (disk only). A fenced
        session is released without a commit: nothing more is written for it."""
        if self.state != "resident":
            return
        if self.commits.fence is not None:
            self.abandon()
            return
        if not residence.settle_check(self):  # a pass beside that failed released it: nothing to commit
            return
        t0 = time.perf_counter()
        try:
            self.commit()
        finally:
            t1 = time.perf_counter()
            residence.release(self)
        self.suspend_timing = {"commit_s": t1 - t0, "release_s": time.perf_counter() - t1}
        log.info("session.suspend", id=self.id, committed=self.manifest.committed)

    def abandon(self) -> None:
        """Drop the session WITHOUT committing, as a crash would (staged records are lost)."""
        if self.state == "resident":
            residence.release(self)
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

    # ---- commits and turns -------------------------------------------------------------------
    def commit(self) -> int:
        """kv commit (the commit point), then the manifest's dynamic fields; returns the count
        (:meth:`CommitPath.begin`); a checksum pass still running beside is awaited first."""
        residence.await_check(self)
        return self.commits.begin()()

    def generate(self, prompt_ids: Sequence[int] | None = None, max_new: int = 16, *,
                 stop_at_eos: bool = False, sampler: Sampler | TurnDraw | None = None, keep_sampler: bool = True,
                 on_token: Callable[[int, int], None] | None = None) -> TurnReply:
        """One turn (:func:`~sessionstore.sessions.session_turns.generate`); its ids and its room in the
        context checked first (:func:`~sessionstore.sessions.session_turns.check_turn`), before any work."""
        turns.check_turn(self, prompt_ids, max_new)
        return turns.generate(self, prompt_ids, max_new, stop_at_eos=stop_at_eos, sampler=sampler,
                              keep_sampler=keep_sampler, on_token=on_token)

    def append_tokens(self, tokens: Sequence[int], *, commit: bool | None = None) -> np.ndarray:
        """Feed ``tokens`` as records without sampling (:func:`~sessionstore.sessions.session_turns.append_tokens`)."""
        return turns.append_tokens(self, turns.check_ids(self, list(tokens)).tolist(), commit=commit)

    def truncate(self, n: int) -> int:
        """Keep the first ``n`` records (:func:`~sessionstore.sessions.session_turns.truncate`)."""
        return turns.truncate(self, n)


__all__ = ["Session"]
