"""The engine core's loop: ONE thread owns the decoder and every resident session, and runs each
request's work as a job it schedules, not as a thread it waits for.

A job (a turn, a session operation) is a function run as a greenlet: a continuation on the loop's
own thread, switched to by the loop only, so exactly one piece of work touches the sessions at a
time and no lock guards them. A job runs until it needs the model or a wait, and then hands the
loop what it waits for, as data:

- ``forward`` (a prompt, or one token): a :class:`~.batched_step.Forward` queued for the next batched step;
- ``drive_decode`` (a turn's sampling, a :class:`sessionstore.sessions.RunningTurn`: plain data, its
  draw, eos ids, counts and end): the loop holds it among its running turns, advances every one
  of them with its row of each step's logits (sampling, streaming and the turn's mid-turn commits
  run in the step's postprocess, :mod:`.batched_step`) and steps the token each draws; it switches
  back to the job only once the turn has ended: a decode token costs no switch and no generator;
- ``run_commit`` of a commit that no pass put off (a turn's last one): run by an I/O thread while
  the job waits and the loop steps the others on (its fsyncs hold no other session back).

The loop, over and over: take what arrived from other threads (new jobs, ended waits), run every
runnable job until it waits again, then ONE batched step (``model.step``) of every waiting request:

- every single-token forward (a decode step, or a one-token prompt) of every session
  (continuous batching: sessions join and leave between steps);
- beside them, short prompts whole (at most ``whole_prompt_tokens`` of them a step) and chunks of
  the longer ones waiting to be prefilled, at most ``max_prefill_tokens`` tokens a step in arrival
  order (chunked prefill: a long prompt is admitted over several steps while the running streams
  keep decoding; its job runs on once its last chunk has run); a step in
  which no session decodes takes up to ``IDLE_PREFILL_TOKENS`` (new sessions arriving together
  start in the step after the one they arrive during; an idle loop woken by a job may wait
  ``gather_s`` for the ones that follow it, 0 by default).

``model.step`` computes every row as a decode step of that token alone would
(:mod:`kernels.model.decoder`), so a session's logits, and so its tokens, are bitwise what it would
get alone, whoever shares the step and however its prompt was cut into chunks. A request that
would fail (a token outside the vocabulary, a full context) fails alone: it is checked before it
joins, and should the batched step raise, its members are stepped one by one (bitwise the same).
The mid-turn commits that the loops ask for in one pass start together at its end and run while
the next step computes (:mod:`.group_commit`). The step itself is :mod:`.batched_step`'s, and how
much prompt it carries :mod:`.prefill_pacer`'s; this module runs the jobs around it.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import greenlet
import numpy as np

from sessionstore.log import get_logger
from sessionstore.service.steps.batched_step import BatchedStep, Forward
from sessionstore.service.steps.group_commit import GroupCommit
from sessionstore.service.steps.prefill_pacer import (
    MAX_PREFILL_TOKENS,
    PREFILL_STEP_RATIO,
    WHOLE_PROMPT_TOKENS,
    PrefillPacer,
)
from sessionstore.sessions import RunningTurn, drive_inline

log = get_logger("service")

# how long an idle loop woken by a job waits for the jobs arriving right after it. 0: the first job starts at
# once and those arriving during its step join the next one (continuous batching). The 4 ms it was made 40%
# of a lone request's first token once the step was compiled (bench.peer, ours / llama.cpp: TTFT of one
# 1.70 -> 0.74; the median of 16 at once 1.13 -> 0.86: they lost nothing by not waiting for each other)
GATHER_S = 0.0
IO_THREADS = 8  # threads for the waits jobs hand off (commits no pass put off, sessions' file work)
# "0": every session's tail commit syncs alone (one fdatasync each), not one barrier per pass for all
# (group_commit); bench.durable_stream measures the two
SHARED_BARRIER_ENV = "COLI_SHARED_BARRIER"

T = TypeVar("T")
Resume = Callable[[], Any]  # what a parked job is switched back with: returns its value or raises its error


@dataclass(eq=False)
class _Job:
    """One request's work: ``fn`` run as a greenlet on the loop's thread; its outcome in ``future``."""

    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)
    glet: greenlet.greenlet | None = None


class EngineLoop:
    """The loop's thread, its jobs and its queue of forwards."""

    def __init__(self, model: Any, *, max_batch: int = 64, gather_s: float = GATHER_S,
                 max_prefill_tokens: int = MAX_PREFILL_TOKENS, prefill_step_ratio: float = PREFILL_STEP_RATIO,
                 on_forward: Callable[[str, int, float], None] | None = None,
                 whole_prompt_tokens: int = WHOLE_PROMPT_TOKENS) -> None:
        self.model, self.gather_s = model, gather_s
        self.after_pass: Callable[[], None] | None = None  # before a pass's step and at its end (sends events)
        self.commits = GroupCommit(max_batch, share=os.environ.get(SHARED_BARRIER_ENV, "1") != "0")
        # the loops' mid-turn commits, one group per pass
        # the step, its queue of forwards and its count of steps; on_forward is called with
        # ("step" | "prefill", sessions, seconds) of each forward
        self.batch = BatchedStep(model, self.commits, PrefillPacer(max_prefill_tokens, prefill_step_ratio),
                                 max_batch=max_batch, max_prefill_tokens=max_prefill_tokens,
                                 on_settled=self._run_on_after, on_forward=on_forward,
                                 whole_prompt_tokens=whole_prompt_tokens)
        self._cond = threading.Condition()  # guards _arrived, the counts and _stopped
        self._arrived: deque[tuple[_Job, Resume | None] | Forward] = deque()  # from other threads
        self._in_flight = 0  # jobs submitted and not ended
        self._submitted = self._gathered = 0  # jobs submitted; of them, taken by the loop
        self._stopped = False
        self._runnable: deque[tuple[_Job, Resume | None]] = deque()  # the loop's thread only
        self._current: _Job | None = None  # the job running now (the loop's thread only)
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="coli-engine-io")
        self.thread = threading.Thread(target=self._run, name="coli-engine", daemon=True)
        self.thread.start()

    # ---- from any thread ------------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` as a job on the loop (it may call :meth:`forward`, :meth:`drive_decode`
        and :meth:`run_commit`); its outcome, once it has ended."""
        job = _Job(fn)
        with self._cond:
            if self._stopped:
                raise RuntimeError("the engine loop has stopped")
            self._in_flight += 1
            self._submitted += 1
            self._arrived.append((job, None))
            self._cond.notify_all()
        return job.future

    def in_flight(self) -> int:
        """Jobs submitted and not ended."""
        with self._cond:
            return self._in_flight

    def wait_idle(self) -> None:
        """Wait until every job submitted has ended."""
        with self._cond:
            while self._in_flight and self.thread.is_alive():
                self._cond.wait(0.5)

    def stop(self) -> None:
        """Stop the loop once its jobs have ended; wait for the commits started."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join()
        self.commits.close()
        self._io.shutdown(wait=True)

    # ---- what a job calls ------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, cache: Any, *, checked: bool = False) -> np.ndarray:
        """``model.forward(tokens, cache)`` as part of a batched step (a prompt of several tokens
        in chunks, beside other sessions' steps): the logits of its LAST position, [1, V] f32.
        From a job it waits as the loop steps; from the loop itself or a stopped loop it runs here;
        from another thread it waits for the loop. ``checked``: the caller checked the ids and their
        room where they entered (a session's turn, through :class:`LoopDecoder`), so the loop trusts
        them; else it checks them before the step, so that a forward that cannot run fails alone."""
        job = self._job_here()
        if job is not None:
            self.batch.queue.append(Forward(np.asarray(tokens), cache, job=job, checked=checked))
            logits: np.ndarray = self._park()
            return logits
        if self._on_loop_thread() or self._stopped:
            out: np.ndarray = self.model.forward(tokens, cache)[-1:]  # [1, V] f32
            return out
        work = Forward(np.asarray(tokens), cache, done=threading.Event(), checked=checked)
        with self._cond:
            self._arrived.append(work)
            self._cond.notify_all()
        work.done.wait()  # type: ignore[union-attr]
        logits = work.outcome()
        return logits

    def drive_decode(self, turn: RunningTurn, cache: Any) -> RunningTurn:
        """Run a turn's sampling: its first token is drawn here, then the loop holds it among its
        running turns (advanced after each step with its row of the step's logits, its token
        stepped next) and the job runs on once it has ended (or raised). Outside a job, or on a
        stopped loop: it runs here, one :meth:`forward` per token."""
        job = self._job_here()
        if job is None or self._stopped:
            return drive_inline(self, cache, turn)
        token = turn.start()
        if token is None:
            return turn
        self.batch.queue.append(Forward(np.asarray([token], dtype="<i4"), cache, job=job, turn=turn))
        ended: RunningTurn = self._park()
        return ended

    def run_commit(self, commit: Callable[[], object], *, overlap: bool = False) -> None:
        """A turn's commit (the part a session's ``commit_runner`` is handed, which touches neither
        the cache nor the pending token): put off to the end of this pass when the loop is running
        the turn's decode loop on (:mod:`.group_commit`); from a job, run by an I/O thread while the
        job waits and the loop steps the others on; else run now. ``overlap``: the decode loop may
        run on while the commit is in flight (its session guards its writer: :meth:`GroupCommit.ready`)."""
        if self.commits.put_off(commit, overlap=overlap):
            return
        if self._job_here() is None:
            commit()
            return
        self.wait_for(commit)

    def wait_for(self, fn: Callable[[], T]) -> T:
        """From a job: ``fn()`` run by an I/O thread while the job waits (the loop steps on); its
        value, or its error raised here. Elsewhere (the loop itself, another thread): ``fn()`` here.
        A session's :class:`~sessionstore.sessions.session_home.IoRunner` (its creation's and its
        resumes' file work) and the commits no pass put off run so."""
        job = self._job_here()
        if job is None:
            return fn()
        future = self._io.submit(fn)
        future.add_done_callback(lambda done: self._wake(job, done.result))
        value: T = self._park()
        return value

    def start_io(self, fn: Callable[[], T]) -> Future[T]:
        """``fn()`` started on an I/O thread now, from anywhere; its future (a session's
        :class:`~sessionstore.sessions.session_home.IoStarter`: a new session's files are made so
        while its first turn runs, and :meth:`wait_for` waits for them at its first commit)."""
        return self._io.submit(fn)

    # ---- the jobs' side, on the loop's thread ----------------------------------------------------
    def _on_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def _job_here(self) -> _Job | None:
        """The job this code runs in (None: the loop itself, or another thread)."""
        return self._current if self._on_loop_thread() else None

    def _park(self) -> Any:
        """Switch from the running job back to the loop; return what it is resumed with."""
        hub = greenlet.getcurrent().parent
        assert hub is not None
        resume: Resume = hub.switch()
        return resume()

    def _wake(self, job: _Job, resume: Resume) -> None:
        """From any thread: make a parked job runnable, resumed with ``resume``."""
        with self._cond:
            self._arrived.append((job, resume))
            self._cond.notify_all()

    def _job_body(self, job: _Job) -> None:
        """A job's greenlet: run its function, settle its future (after the job has left the
        count, so a caller that waits for the outcome finds the loop idle)."""
        result: Any = None
        error: BaseException | None = None
        try:
            result = job.fn()
        except BaseException as exc:  # handed to whoever waits for the job
            error = exc
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _run_jobs(self) -> None:
        """Run every runnable job until it waits (or ends)."""
        while self._runnable:
            job, resume = self._runnable.popleft()
            if job.glet is None:
                if not job.future.set_running_or_notify_cancel():
                    with self._cond:
                        self._in_flight -= 1
                        self._cond.notify_all()
                    continue
                job.glet = greenlet.greenlet(lambda j=job: self._job_body(j))
                self._current = job
                job.glet.switch()
            else:
                self._current = job
                job.glet.switch(resume)
            self._current = None

    def _run_on_after(self, work: Forward) -> None:
        """``work`` is settled: its job runs on, or the caller on another thread is woken."""
        if work.job is not None:
            self._runnable.append((work.job, work.outcome))
        elif work.done is not None:
            work.done.set()

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._take_arrived():
                self._run_jobs()
                if self.batch.queue:
                    if self.after_pass is not None:  # what the jobs put goes before the step, not after it
                        self.after_pass()  # (a turn's first piece, drawn from its prompt's logits)
                    self.batch.run()
                if self.after_pass is not None:
                    self.after_pass()
        except BaseException as exc:  # a bug here would hang every job: log it; the process ends
            log.critical("service.engine_loop_failed", error=repr(exc))
            raise

    def _take_arrived(self) -> bool:
        """Move what arrived from other threads onto the loop's lists; wait for it when the loop
        has nothing to do (then ``gather_s`` more for the jobs that follow the first). False once
        stopped with nothing left to run."""
        with self._cond:
            idle = not self._runnable and not self.batch.queue
            if idle:
                while not self._arrived and not (self._stopped and self._in_flight == 0):
                    self._cond.wait()
                if not self._arrived:
                    return False
                if self._submitted != self._gathered:  # woken by a new job: the next may follow it
                    deadline = time.monotonic() + self.gather_s
                    seen = self._submitted
                    while (left := deadline - time.monotonic()) > 0:
                        self._cond.wait(left)
                        if self._submitted > seen:  # another arrived: give the next one gather_s too
                            seen, deadline = self._submitted, time.monotonic() + self.gather_s
            self._gathered = self._submitted
            arrived, self._arrived = self._arrived, deque()
        for item in arrived:
            if isinstance(item, Forward):
                self.batch.queue.append(item)
            else:
                self._runnable.append(item)
        return True


class LoopDecoder:
    """The model as jobs see it: every attribute is the decoder's, but ``forward`` is a part of the
    loop's batched steps (:meth:`EngineLoop.forward`). Its callers are the sessions' turns, whose ids
    were checked where they entered (the server's core, the CLI, the Session API): the loop trusts them."""

    def __init__(self, model: Any, loop: EngineLoop) -> None:
        self._model, self._loop = model, loop

    def forward(self, tokens: np.ndarray, cache: Any) -> np.ndarray:
        """The logits of the last of ``tokens``' positions, [1, V] f32."""
        return self._loop.forward(tokens, cache, checked=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


__all__ = ["GATHER_S", "IO_THREADS", "EngineLoop", "LoopDecoder"]
