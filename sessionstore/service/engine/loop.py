"""The engine core's loop: ONE thread owns the decoder and every resident session, and runs each
request's work as a job it schedules, not as a thread it waits for.

A job (a turn, a session operation) is a function run as a greenlet: a continuation on the loop's
own thread, switched to by the loop only, so exactly one piece of work touches the sessions at a
time and no lock guards them. A job runs until it needs the model or a wait, and then hands the
loop what it waits for, as data:

- ``forward`` (a prompt, or one token): a :class:`_Work` queued for the next batched step;
- ``drive_decode`` (a turn's sampling loop, :func:`sessionstore.sessions.turn_loop.decode_loop`): the
  loop itself sends the generator each step's logits and steps the token it yields (sampling,
  streaming and the turn's mid-turn commits run on the loop), and switches back to the job once the
  generator has ended: a decode token costs no switch at all;
- ``run_commit`` of a commit that no pass put off (a turn's last one): run by an I/O thread while
  the job waits and the loop steps the others on (its fsyncs hold no other session back).

The loop, over and over: take what arrived from other threads (new jobs, ended waits), run every
runnable job until it waits again, then ONE batched step (``model.step``) of every waiting request:

- every single-token forward (a decode step, or the last token of a prompt) of every session
  (continuous batching: sessions join and leave between steps);
- beside them, chunks of the prompts waiting to be prefilled, at most ``max_prefill_tokens``
  tokens a step in arrival order (chunked prefill: a long prompt is admitted over several steps
  while the running streams keep decoding; its job runs on once its last chunk has run); a step in
  which no session decodes takes up to ``IDLE_PREFILL_TOKENS`` (new sessions arriving together
  start together: an idle loop woken by a job waits ``gather_s`` for the ones that follow it).

``model.step`` computes every row as a decode step of that token alone would
(:mod:`kernels.model.decoder`), so a session's logits, and so its tokens, are bitwise what it would
get alone, whoever shares the step and however its prompt was cut into chunks. A request that
would fail (a token outside the vocabulary, a full context) fails alone: it is checked before it
joins, and should the batched step raise, its members are stepped one by one (bitwise the same).
The mid-turn commits that the loops ask for in one pass start together at its end and run while
the next step computes (:mod:`.group_commit`).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import greenlet
import numpy as np

from sessionstore.log import get_logger
from sessionstore.service.engine.group_commit import GroupCommit
from sessionstore.sessions import DecodeLoop, TurnEnd, drive_inline

log = get_logger("service")

GATHER_S = 0.004  # how long an idle loop woken by a job waits for the jobs arriving right after it
MAX_PREFILL_TOKENS = 32  # prompt tokens one step carries beside the decode tokens (bench.serve measures the choice)
IDLE_PREFILL_TOKENS = 2048  # prompt tokens one step carries when no session in it decodes: no stream to keep flowing
IO_THREADS = 8  # threads for the waits jobs hand off (commits no pass put off)
PREFILL_STEP_RATIO = 3  # a step carrying prompt chunks beside decoding sessions is sized to take at
# most this many times their decode-only step (so a running stream's longest gap stays near it)

Resume = Callable[[], Any]  # what a parked job is switched back with: returns its value or raises its error


@dataclass(eq=False)
class _Job:
    """One request's work: ``fn`` run as a greenlet on the loop's thread; its outcome in ``future``."""

    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)
    glet: greenlet.greenlet | None = None


@dataclass(eq=False)  # compared by identity (the queue holds each once)
class _Work:
    """One forward asked for (or a decode loop's next token), and its outcome: the logits, the
    loop's end or the error, set by the loop before its asker runs on (a job: made runnable; a
    caller on another thread: its ``done`` event)."""

    tokens: np.ndarray  # [S] i32
    cache: Any
    fed: int = 0  # tokens of ``tokens`` already stepped (a prompt admitted chunk by chunk)
    job: _Job | None = None  # the job that waits for it
    done: threading.Event | None = None  # a caller outside the jobs (a test, a tool) waits on it
    loop: DecodeLoop | None = None  # a turn's sampling loop, run on by the loop after each step
    result: Any = None  # the logits [S, V] f32, or the loop's TurnEnd
    error: BaseException | None = None
    settled: bool = False

    def settle(self, result: Any, error: BaseException | None = None) -> None:
        self.result, self.error, self.settled = result, error, True

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        assert self.settled  # settled before the asker ran on
        return self.result


class PrefillPacer:
    """How many prompt tokens a step may carry beside decoding sessions: at most ``cap``, and as
    many as keep the step within ``ratio`` times a decode-only step of those sessions, by what the
    loop's steps measured (a token of prompt costs more the further into a long prompt it is, and
    more than a decode row on a CPU: each position is computed as its own decode step would be)."""

    SMOOTH = 0.3  # weight of the newest measurement in the running estimates

    def __init__(self, cap: int, ratio: float = PREFILL_STEP_RATIO) -> None:
        self.cap, self.ratio = cap, ratio  # ratio 0: no pacing, the cap alone
        self.decode_row_s: float | None = None  # a decode-only step's seconds per session
        self.prompt_token_s: float | None = None  # seconds per prompt token beside (or without) decoding

    def budget(self, decoding: int) -> int:
        """Prompt tokens for a step in which ``decoding`` sessions decode (>= 1)."""
        if not self.ratio or self.decode_row_s is None or not self.prompt_token_s:  # off, unmeasured, or
            return self.cap  # too cheap to tell
        room = (self.ratio - 1.0) * decoding * self.decode_row_s
        return max(1, min(self.cap, int(room / self.prompt_token_s)))

    def observe(self, decoding: int, prompt_tokens: int, seconds: float) -> None:
        """One step's size and time."""
        if prompt_tokens == 0:
            self.decode_row_s = self._blend(self.decode_row_s, seconds / max(decoding, 1))
            return
        decode_part = decoding * (self.decode_row_s or 0.0)
        self.prompt_token_s = self._blend(self.prompt_token_s, max(seconds - decode_part, 0.0) / prompt_tokens)

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTH * (new - old)


class EngineLoop:
    """The loop's thread, its jobs and its queue of forwards."""

    def __init__(self, model: Any, *, max_batch: int = 64, gather_s: float = GATHER_S,
                 max_prefill_tokens: int = MAX_PREFILL_TOKENS, prefill_step_ratio: float = PREFILL_STEP_RATIO,
                 on_forward: Callable[[str, int, float], None] | None = None) -> None:
        self.model = model
        self.max_batch, self.gather_s = max_batch, gather_s
        self.max_prefill_tokens = max_prefill_tokens
        self.pacer = PrefillPacer(max_prefill_tokens, prefill_step_ratio)
        self.on_forward = on_forward  # called with ("step" | "prefill", sessions, seconds) of each forward
        self.steps = 0
        self.commits = GroupCommit(max_batch)  # the loops' mid-turn commits, one group per pass
        self._cond = threading.Condition()  # guards _arrived, the counts and _stopped
        self._arrived: deque[tuple[_Job, Resume | None] | _Work] = deque()  # from other threads
        self._in_flight = 0  # jobs submitted and not ended
        self._submitted = self._gathered = 0  # jobs submitted; of them, taken by the loop
        self._stopped = False
        self._runnable: deque[tuple[_Job, Resume | None]] = deque()  # the loop's thread only
        self._queue: list[_Work] = []  # forwards waiting for a step; the loop's thread only
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
    def forward(self, tokens: np.ndarray, cache: Any) -> np.ndarray:
        """``model.forward(tokens, cache)`` as part of a batched step (a prompt of several tokens
        in chunks, beside other sessions' steps): the logits of its LAST position, [1, V] f32.
        From a job it waits as the loop steps; from the loop itself or a stopped loop it runs here;
        from another thread it waits for the loop."""
        job = self._job_here()
        if job is not None:
            self._queue.append(_Work(np.asarray(tokens), cache, job=job))
            logits: np.ndarray = self._park()
            return logits
        if self._on_loop_thread() or self._stopped:
            out: np.ndarray = self.model.forward(tokens, cache)[-1:]  # [1, V] f32
            return out
        work = _Work(np.asarray(tokens), cache, done=threading.Event())
        with self._cond:
            self._arrived.append(work)
            self._cond.notify_all()
        work.done.wait()  # type: ignore[union-attr]
        logits = work.outcome()
        return logits

    def drive_decode(self, loop: DecodeLoop, cache: Any) -> TurnEnd:
        """Run a turn's decode loop: its first token is taken here, then the loop runs it on
        between steps (each step's logits sent in, the token it yields stepped next) and the job
        runs on once it has ended (or raised). Outside a job, or on a stopped loop: the loop runs
        here, one :meth:`forward` per token."""
        job = self._job_here()
        if job is None or self._stopped:
            return drive_inline(self, cache, loop)
        try:
            token = next(loop)
        except StopIteration as done:
            end: TurnEnd = done.value
            return end
        self._queue.append(_Work(np.asarray([token], dtype="<i4"), cache, job=job, loop=loop))
        end = self._park()
        return end

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

    def wait_for(self, fn: Callable[[], Any]) -> Any:
        """From a job: ``fn()`` run by an I/O thread while the job waits (the loop steps on); its
        value, or its error raised here. Elsewhere: ``fn()`` here."""
        job = self._job_here()
        if job is None:
            return fn()
        future = self._io.submit(fn)
        future.add_done_callback(lambda done: self._wake(job, done.result))
        return self._park()

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

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._take_arrived():
                self._run_jobs()
                if self._queue:
                    batch, self._queue = self._plan(self._queue)
                    self._step(batch)
        except BaseException as exc:  # a bug here would hang every job: log it; the process ends
            log.critical("service.engine_loop_failed", error=repr(exc))
            raise

    def _take_arrived(self) -> bool:
        """Move what arrived from other threads onto the loop's lists; wait for it when the loop
        has nothing to do (then ``gather_s`` more for the jobs that follow the first). False once
        stopped with nothing left to run."""
        with self._cond:
            idle = not self._runnable and not self._queue
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
            if isinstance(item, _Work):
                self._queue.append(item)
            else:
                self._runnable.append(item)
        return True

    def _plan(self, taken: list[_Work]) -> tuple[list[tuple[_Work, int]], list[_Work]]:
        """One step's members, each with the tokens it steps (1, or a prompt's next chunk), and
        what waits for a later step: at most ``max_batch`` members, prompts in arrival order, and
        while any member decodes at most the :class:`PrefillPacer`'s budget of prompt tokens (at
        most ``max_prefill_tokens``; the budget keeps the running streams flowing); a step with no
        one decoding takes up to ``IDLE_PREFILL_TOKENS``."""
        batch: list[tuple[_Work, int]] = []
        later: list[_Work] = []
        decoding = sum(work.tokens.shape[0] - work.fed == 1 for work in taken)
        budget = self.pacer.budget(decoding) if decoding else max(self.max_prefill_tokens, IDLE_PREFILL_TOKENS)
        for work in taken:
            want = work.tokens.shape[0] - work.fed
            take = 1 if want == 1 else min(want, budget)
            if take < 1 or len(batch) >= self.max_batch:
                later.append(work)
                continue
            if want > 1:
                budget -= take
            batch.append((work, take))
        return batch, later

    def _step(self, batch: list[tuple[_Work, int]]) -> None:
        ready: list[tuple[_Work, int]] = []
        for work, count in batch:  # a request that cannot run fails alone, before the step
            try:
                if work.fed == 0:
                    self.model.check_tokens(work.tokens)
                    self.model.check_room(work.cache, work.tokens.shape[0])
            except BaseException as exc:
                work.settle(None, exc)
                self._admit(work)
            else:
                ready.append((work, count))
        if not ready:
            return
        counts = [count for _, count in ready]
        tokens = np.concatenate([w.tokens[w.fed : w.fed + c] for w, c in ready])  # [N] i32
        try:
            t0 = time.perf_counter()
            logits = self.model.step([w.cache for w, _ in ready], tokens, counts)  # [B, V] f32
            took = time.perf_counter() - t0
        except BaseException as exc:
            log.warning("service.step_failed", batch=len(ready), error=str(exc))
            for work, count in ready:
                self._solo(work, count)
            return
        self.steps += 1
        rows = sum(1 for work, _ in ready if work.tokens.shape[0] - work.fed == 1)  # single-token members
        self.pacer.observe(rows, sum(counts) - rows, took)
        self._observe("step" if min(counts) == 1 else "prefill", len(ready), took)
        self._stepped(ready, logits)

    def _solo(self, work: _Work, count: int) -> None:
        """Step ``work``'s next ``count`` tokens alone (a batched step that raised)."""
        try:
            t0 = time.perf_counter()
            logits = self.model.step([work.cache], work.tokens[work.fed : work.fed + count], [count])
            self._observe("step" if count == 1 else "prefill", 1, time.perf_counter() - t0)
        except BaseException as exc:  # the job that asked re-raises it
            work.settle(None, exc)
            self._admit(work)
            return
        self._stepped([(work, count)], logits)

    def _stepped(self, ready: list[tuple[_Work, int]], logits: np.ndarray) -> None:
        """After a step: a prompt with chunks left waits for the next step (first in line); every
        other member gets its row of ``logits`` [B, V]: a plain forward is settled and its asker
        runs on; a decode loop is run on to its next token (queued for the next step) or its end."""
        done: list[tuple[_Work, int]] = []
        unfinished: list[_Work] = []
        for b, (work, count) in enumerate(ready):
            work.fed += count
            if work.fed < work.tokens.shape[0]:
                unfinished.append(work)
            else:
                done.append((work, b))
        self._queue[:0] = unfinished
        admitted: list[_Work] = []
        for work, b in done:
            if work.loop is None:
                work.settle(logits[b : b + 1])  # [1, V] f32, as forward returns
            else:
                with self.commits.collecting(work):
                    if self._run_on(work, logits[b]):
                        continue
            admitted.append(work)
        self.commits.start_all()  # they run while the next step computes; each loop waits for its own
        for work in admitted:  # in batch order
            self._admit(work)

    def _run_on(self, work: _Work, logits: np.ndarray) -> bool:
        """Send a decode loop its logits [V]: True once it yielded its next token (queued for the
        next step), False once it ended or raised (settled)."""
        assert work.loop is not None
        failed = self.commits.ready(work)  # the commit its last pass asked for, run beside this step
        if failed is not None:  # its turn ends as it would have before the step: the step is undone
            work.cache.truncate(work.cache.length - 1)
            work.settle(None, failed)
            return False
        try:
            token = work.loop.send(logits)
        except StopIteration as ended:
            work.settle(ended.value)
            return False
        except BaseException as exc:  # a stop, a commit's failure: its turn re-raises it
            work.settle(None, exc)
            return False
        work.tokens, work.fed = np.asarray([token], dtype="<i4"), 0  # [1] i32
        self._queue.append(work)
        return True

    def _admit(self, work: _Work) -> None:
        """The forward is settled: its job runs on (in the order forwards finish), or the caller on
        another thread is woken. A commit its decode loop asked for last is waited for first (its
        failure is the turn's error): a turn never finds its commit unfinished."""
        failed = self.commits.wait(work)
        if failed is not None:
            work.settle(None, failed)
        if work.job is not None:
            self._runnable.append((work.job, work.outcome))
        elif work.done is not None:
            work.done.set()

    def _observe(self, kind: str, sessions: int, seconds: float) -> None:
        if self.on_forward is not None:
            self.on_forward(kind, sessions, seconds)


class LoopDecoder:
    """The model as jobs see it: every attribute is the decoder's, but ``forward`` is a part of the
    loop's batched steps (:meth:`EngineLoop.forward`)."""

    def __init__(self, model: Any, loop: EngineLoop) -> None:
        self._model, self._loop = model, loop

    def forward(self, tokens: np.ndarray, cache: Any) -> np.ndarray:
        """The logits of the last of ``tokens``' positions, [1, V] f32."""
        return self._loop.forward(tokens, cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


__all__ = ["GATHER_S", "IDLE_PREFILL_TOKENS", "MAX_PREFILL_TOKENS", "PREFILL_STEP_RATIO", "EngineLoop", "LoopDecoder",
           "PrefillPacer"]
