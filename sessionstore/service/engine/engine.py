"""The engine: the decoder and every open session, owned by the engine loop
(:mod:`sessionstore.service.steps.loop`), and what a request may ask of them.

A request's work (a turn, a session operation) is a job the loop runs on its own thread: the jobs
run one at a time and touch the sessions without a lock; the loop batches every waiting session's
forward into one step, runs each turn's decode loop between steps, and admits long prompts in
chunks beside them. Two requests on one session never interleave: while a session has work queued
or running, another request on it is refused with 409, or, when the turn holding it has ended and only
commits, waits a few seconds for it (:mod:`.claims`). Past
``max_resident`` resident sessions (or ``max_kv_bytes``) the least recently used idle one is
suspended (commit, release memory and lock); its next request resumes it token-exact. Shutdown
cuts every running turn at its next token, waits for the jobs in flight, then commits and suspends
every session.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from kernels.errors import ChecksumMismatchError
from kernels.model.text import ChatTokenizer
from sessionstore.log import get_logger
from sessionstore.service.engine.claims import Claims
from sessionstore.service.engine.fencing import FencedSessions
from sessionstore.service.engine.fleet_hooks import FleetHooks, NoFleet
from sessionstore.service.engine.metrics import EngineMetrics
from sessionstore.service.engine.tiers import TierManager
from sessionstore.service.engine.turns import Admitted, TurnRunner, TurnSink
from sessionstore.service.errors import ApiError
from sessionstore.service.limits import ServiceLimits
from sessionstore.service.steps import EngineLoop, LoopDecoder
from sessionstore.service.wire import TurnOutcome, TurnSpec
from sessionstore.sessions import (
    Session,
    SessionOptions,
    SessionStore,
    read_record,
    settle_check,
    validate_session_id,
    write_record,
)

log = get_logger("service")


class Engine:
    """The engine loop (every request's work a job on its thread), the decoder behind it, the open
    sessions and the residency limits.

    Why 21 methods: they are one table's, the open sessions, which only the loop's thread touches (open,
    turn, suspend, delete, fork, forget, fence, the residency that follows from them, and the
    counts read of it); split, the halves would share that table and its claims."""

    def __init__(self, store: SessionStore, model_source: str, *, kv_dtype: str = "fp8",
                 tokenizer: ChatTokenizer | None = None, limits: ServiceLimits | None = None,
                 metrics: EngineMetrics | None = None, session_options: SessionOptions | None = None,
                 max_kv_bytes: int | None = None, home: Any = None, max_disk_bytes: int | None = None) -> None:
        self.store = store
        self.home = home  # the fleet (serve --remote: a fleet.FleetHome, its store and listing), else None
        self.fleet: FleetHooks = NoFleet() if home is None else home  # what a session's life asks of it
        self.model_source = model_source
        self.limits = limits or ServiceLimits()
        self.metrics = metrics or EngineMetrics()
        decoder, self.model_ref = store.load_model(model_source)
        self.loop = EngineLoop(decoder, max_batch=self.limits.max_batch,
                               max_prefill_tokens=self.limits.max_prefill_tokens,
                               prefill_step_ratio=self.limits.prefill_step_ratio,
                               whole_prompt_tokens=self.limits.whole_prompt_tokens,
                               on_forward=self.metrics.observe_forward)
        self.model = LoopDecoder(decoder, self.loop)
        store.adopt_model(model_source, self.model)  # the store's sessions decode through the loop
        self.kv_dtype = kv_dtype
        self.runner = TurnRunner(self.model, tokenizer, kv_dtype, self.limits.default_max_tokens,
                                 drive=self.loop.drive_decode)
        # lazy_logits (unless session_options say otherwise): a request that feeds tokens resumes
        # without recomputing the last position when the sidecar vouched for every record (FORMAT.md
        # 5.5); one that continues checks it then. The loop runs every session's commits and
        # decoding, and its file work (its creation, a resume's opening and mapping, the catalogue's
        # row) on the loop's I/O threads while the loop steps the other sessions; a new session's
        # files are made there while its first turn runs (io_start: its first commit waits for them).
        self.options = replace(session_options or SessionOptions(lazy_logits=True),
                               commit_runner=self.loop.run_commit, decode_driver=self.loop.drive_decode,
                               io_runner=self.loop.wait_for, io_start=self.loop.start_io)
        self.max_kv_bytes = max_kv_bytes
        self.stopping = threading.Event()
        self.last_use: dict[str, float] = {}
        self._sessions: dict[str, Session] = {}  # touched only by the loop's jobs
        self.claims = Claims()  # which request holds each session; the requests waiting for one
        self.fences = FencedSessions(self.metrics)  # sessions fenced by a failed commit (sessions.fence)
        self.metrics.bind_sessions(self.resident_count, self.suspended_count, store.residency.resident_bytes,
                                   lambda: self.loop.batch.steps, self.loop.commits.in_flight)
        # the disk budget (None: none), offload and restore (with a home), retention: FORMAT.md 5.10
        self.tiers = TierManager(self, max_disk_bytes=max_disk_bytes)

    # ---- work --------------------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any], *, session: str | None = None, turn: bool = False,
               then: Callable[[Any], Any] | None = None, cut: Callable[[], bool] | None = None) -> Future[Any]:
        """Run ``fn`` as a job on the loop holding ``session`` (:meth:`Claims.take_or_wait`: refused
        with 409 while a turn still generating holds it; started once it is released when a turn that
        has ended holds it); its future. ``cut``: asked whether this request's client has gone (a turn
        whose stream was cut has ended). The session is free again BEFORE the outcome is delivered, so
        a client that waits for its reply and asks again is never refused. ``then`` (given ``fn``'s
        result; its own result is the job's) runs after the session is free: what it makes visible (a
        stored response a client polls for) is never seen while the session is still held."""
        if self.stopping.is_set():
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        queued = self.loop.in_flight()
        if turn and queued >= self.limits.max_queued_turns:
            raise ApiError(503, f"{queued} requests are in flight; try again later", code="busy")

        def job() -> Any:
            try:
                result = fn()
            finally:
                self.claims.release(session)
            return result if then is None else then(result)

        def start() -> Future[Any]:  # holding the session (if any)
            if self.stopping.is_set():
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            try:
                return self.loop.submit(job)
            except RuntimeError:  # the loop has stopped
                raise ApiError(503, "the server is shutting down", code="shutting_down") from None

        return start() if session is None else self.claims.take_or_wait(session, start, cut)

    def at_token(self) -> bool:
        """A turn's token boundary: True once the server stops (the turn then ends and commits)."""
        return self.stopping.is_set()

    def claim(self, session_id: str) -> None:
        """Hold ``session_id`` now, or refuse with 409 while another request holds it (never waits)."""
        self.claims.take(session_id)

    def release(self, session_id: str | None) -> None:
        """Free ``session_id`` (handed to the first request waiting for it, if any)."""
        self.claims.release(session_id)

    def stop(self) -> None:
        """Refuse new work (the requests waiting for a session get 503 at once), cut running turns at
        their next token, wait for the jobs in flight, then commit and suspend every open session (a
        last job) and stop the loop."""
        self.stopping.set()
        self.claims.close()  # requests waiting for a session: 503 now
        self.loop.wait_idle()
        if self.loop.thread.is_alive():
            self.loop.submit(self._close_all).result()
        else:
            log.error("service.engine_loop_gone", sessions=len(self._sessions))
        self.loop.stop()

    def _close_all(self) -> None:
        for session in list(self._sessions.values()):
            try:
                session.close()
            except Exception as exc:  # one session's failure must not keep the others uncommitted
                log.error("service.close_failed", id=session.id, error=str(exc))
        self._sessions.clear()
        self.fleet.close()  # push back every session still checked out

    # ---- sessions (the loop's jobs) ------------------------------------------------------------
    def open_session(self, session_id: str, *, create: bool, behind: bool = False) -> tuple[Session, bool]:
        """The open session ``session_id``, resident (created if absent and ``create``; with
        ``behind``, a turn's, its files are still being made when it is returned: FORMAT.md 7, and
        a suspended one's checksum pass runs beside the turn's first step, which awaits it before
        anything leaves: ``sessions.session_resume.resume``)."""
        session = self._sessions.get(session_id)
        if session is not None and session.commits.fence is not None:  # fenced: let go of, reopened below
            self.let_go_fenced(session)
            session = None
        self.fences.reopen(self.store, session_id)  # a fenced session: from its verified commit only
        if self.fleet.check_out(session_id, create=create):
            self.forget(session_id)  # the fleet's newer copy was pulled over it: reopen
            session = None
        created = False
        try:
            if session is None:
                options = self.fleet.session_options(session_id, self.options)  # with the fleet's shipping
                if self.store.exists(session_id):
                    session = self.store.open(session_id, self.model_source, options, beside=behind)
                    self._observe_resume(session)
                elif create:
                    session = self.store.create(session_id, self.model_source, kv_dtype=self.kv_dtype,
                                               options=options)
                    created = True
                    if not behind:  # the caller writes into its directory next
                        session.await_files()
                else:
                    raise ApiError(404, f"no session {session_id!r}", code="session_not_found")
                self._sessions[session_id] = session
            elif session.state != "resident":
                session.ensure_resident(beside=behind)
                self._observe_resume(session)
        except ChecksumMismatchError as exc:  # refused: nothing is served from those rows
            self.metrics.records_refused.inc(exc.records)
            raise
        self.fleet.keep(session)  # renew the lease while resident, fence commits
        self.last_use[session_id] = time.time()
        return session, created

    def _observe_resume(self, session: Session) -> None:
        seconds = session.resume_report.get("resume_s")
        if isinstance(seconds, float):
            self.metrics.resume_seconds.observe(seconds)

    def enforce_residency(self, keep: Session | None) -> None:
        """Suspend least recently used idle sessions (never ``keep``, never one with work in
        flight) until the resident ones fit ``max_resident`` and ``max_kv_bytes``."""
        for session in self.store.residency.sessions():  # least recently used first
            if not _over_limits(self.store.residency.sessions(), self.limits.max_resident, self.max_kv_bytes):
                return
            if session is not keep and not self.claims.held(session.id):
                session.suspend()
                self.fleet.check_in(session.id)  # push back and release
                self.metrics.evictions.inc()
                log.info("service.evict", id=session.id, max_resident=self.limits.max_resident)

    def run_turn(self, spec: TurnSpec, sink: TurnSink, admitted: Admitted | None = None) -> TurnOutcome:
        """One turn (a job on the loop): on its session, or stateless. ``admitted``: its prompt as
        :meth:`TurnRunner.admit` checked it, when the caller did (else checked here, once)."""
        if self.stopping.is_set():
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        t0 = time.perf_counter()
        admitted = self.runner.admit(spec) if admitted is None else admitted
        if spec.session is None:
            outcome = self.runner.stateless(spec, sink, self.at_token, admitted)
        else:
            self.tiers.before_turn(spec, admitted)  # room on the disk (else 507), an offloaded session restored
            session, created = self.open_session(spec.session, create=True, behind=True)
            try:
                if spec.tier:  # the request's retention_seconds / pinned
                    session.ensure_resident()  # a checksum pass beside awaited before anything is written
                    session.await_files()  # its tier record goes into its directory
                    self.tiers.after_open(spec)
                sid = spec.session  # its last token drawn: a request on it meanwhile waits for its commit
                outcome = self.runner.on_session(session, spec, sink, self.at_token, admitted,
                                                 on_end=lambda: self.claims.end(sid))
            except BaseException as exc:
                if isinstance(exc, ChecksumMismatchError):  # refused by the pass beside: as open_session counts it
                    self.metrics.records_refused.inc(exc.records)
                settle_check(session)  # a pass beside still running: awaited (a failed one releases the session)
                if session.commits.fence is not None:  # a commit failed with an I/O error: nothing more written
                    self.let_go_fenced(session)
                    raise
                if created and not session.history():  # a refused first turn leaves no session behind
                    self._drop(spec.session)
                raise
            finally:
                self.tiers.after_turn(spec)  # the turn's reserved disk bytes are its file's now
            outcome.created = created
            self.fleet.turn_done(spec.session)  # ship what the turn added before its final event
            self.metrics.commit_seconds.observe(sum(session.commits.timing.values()))
            self.last_use[spec.session] = time.time()
            self.enforce_residency(keep=session)
        self.metrics.tokens.inc(len(outcome.tokens))
        self.metrics.observe_prompt(outcome.prompt_tokens, outcome.reused_prefix)
        self.metrics.turn_seconds.observe(time.perf_counter() - t0)
        return outcome

    def let_go_fenced(self, session: Session) -> None:
        """A fenced session (:mod:`sessionstore.sessions.fence`): released without a commit and
        listed until its next request reopens it; the other sessions carry on."""
        assert session.commits.fence is not None
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]
        session.suspend()  # fenced: released, nothing written
        self.fences.note(session.commits.fence)

    def forget(self, session_id: str) -> None:
        """Let go of a suspended session's object (its files are about to be replaced)."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            session.close()

    def _drop(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            session.close()
        self.fleet.forget(session_id)  # deleted from the fleet first (409 if held elsewhere)
        self.store.delete(session_id)
        self.last_use.pop(session_id, None)

    # ---- session operations (the loop's jobs) -----------------------------------------------------
    def suspend(self, session_id: str) -> None:
        session = self._sessions.get(session_id)
        if session is None and not self.store.exists(session_id):
            raise ApiError(404, f"no session {session_id!r}", code="session_not_found")
        if session is not None:
            session.suspend()
        self.fleet.check_in(session_id)  # push back and release

    def delete(self, session_id: str) -> None:
        if not self.store.exists(session_id) and self.fleet.forget(session_id):
            return  # a session only the fleet had
        if not self.store.exists(session_id):
            raise ApiError(404, f"no session {session_id!r}", code="session_not_found")
        self._drop(session_id)

    def fork(self, session_id: str, new_id: str, at: int | None) -> None:
        validate_session_id(new_id)
        if not self.store.exists(session_id):
            raise ApiError(404, f"no session {session_id!r}", code="session_not_found")
        if self.store.exists(new_id):
            raise ApiError(409, f"session {new_id!r} already exists", code="session_exists")
        source = self._sessions.get(session_id)
        if source is not None:
            source.commit()
        self.store.fork(session_id, new_id, at=at)
        record = read_record(self.store.session_dir(session_id))
        if at is None and record is not None and record.turn is None:  # the same tokens: the same messages
            write_record(self.store.session_dir(new_id), record)

    # ---- what handlers may read ---------------------------------------------------------------
    def state_of(self, session_id: str) -> str:
        session = self._sessions.get(session_id)
        return "resident" if session is not None and session.state == "resident" else "suspended"

    def resident_count(self) -> int:
        return len(self.store.residency.sessions())

    def suspended_count(self) -> int:
        return max(0, len(self.store.directory.ids()) - self.resident_count())


def _over_limits(resident: Sequence[Session], max_resident: int, max_kv_bytes: int | None) -> bool:
    """More ``resident`` sessions than ``max_resident``, or their memory past ``max_kv_bytes``."""
    if len(resident) > max_resident:
        return True
    return max_kv_bytes is not None and sum(s.memory_bytes() for s in resident) > max_kv_bytes


__all__ = ["Engine"]
