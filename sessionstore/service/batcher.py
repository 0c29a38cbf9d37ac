"""The engine thread: the one thread that runs the decoder, batching every session's work into steps.

Turns run in threads of their own (one per request, holding the :class:`DecoderBaton` while they
touch their session), but none of them runs the model: a turn's ``model.forward`` is a
:class:`BatchingDecoder` that hands the work to the :class:`StepBatcher` and parks on the baton
meanwhile; the engine thread admits it back once its forward is done. A turn's sampling loop
(:func:`sessionstore.sessions.turns.decode_loop`) goes to the engine thread whole
(:meth:`StepBatcher.drive_decode`, handed to the sessions as their ``decode_driver``): after each
step that thread, holding the baton for the turns, sends every
loop its logits and steps the token it yields (sampling, streaming and the turn's commits run
there; the commits that loops ask for in one pass start together at its end and run while the next
step computes, :mod:`.group_commit`),
and wakes the turn's thread only once its loop has ended, so a decode token costs no thread
switch. The engine thread gathers what waits and runs ONE batched step (``model.step``) at a time:

- every single-token forward (a decode step, or the last token of a prompt) of every waiting
  session (continuous batching: sessions join and leave between steps);
- beside them, chunks of the prompts waiting to be prefilled, at most ``max_prefill_tokens`` tokens
  a step in arrival order (chunked prefill: a long prompt is admitted over several steps while the
  running streams keep decoding; its asker is woken once its last chunk has run); a step in which
  no session decodes takes up to ``IDLE_PREFILL_TOKENS`` (new sessions arriving together start
  together).

``model.step`` computes every row as a decode step of that token alone would (kernels.model.decoder),
so a session's logits, and so its tokens, are bitwise what it would get alone, whoever shares the
step and however its prompt was cut into chunks. A step starts as soon as every turn in flight is
waiting for it, or once no turn has asked for ``gather_s`` (a turn busy committing does not hold the
others back; it joins the next step). A request that would fail (a token outside the vocabulary, a
full context) fails alone: it is checked before it joins, and should the batched step raise, its
members are stepped one by one (bitwise the same).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sessionstore.log import get_logger
from sessionstore.service.group_commit import GroupCommit
from sessionstore.service.scheduler import DecoderBaton, Ticket
from sessionstore.sessions.turn_loop import DecodeLoop, TurnEnd, drive_inline

log = get_logger("service")

GATHER_S = 0.004  # how long a step waits for the next turn to hand in its token, before it runs without it
MAX_PREFILL_TOKENS = 32  # prompt tokens one step carries beside the decode tokens (bench.serve measures the choice)
IDLE_PREFILL_TOKENS = 2048  # prompt tokens one step carries when no session in it decodes: no stream to keep flowing


@dataclass(eq=False)  # compared by identity (the queue holds each once)
class _Work:
    """One forward asked for (or a decode loop's next token), and its outcome: the logits, the
    loop's end or the error, set by the engine thread before it wakes the asker (a turn parked on
    the baton: admitted again; any other caller: its ``finished`` event). No Future: a turn's
    wake-up already orders the hand-over."""

    tokens: np.ndarray  # [S] i32
    cache: Any
    fed: int = 0  # tokens of ``tokens`` already stepped (a prompt admitted chunk by chunk)
    ticket: Ticket | None = None  # a turn parked on the baton
    finished: threading.Event | None = None  # a caller outside the turns (a test, a tool) waits on it
    loop: DecodeLoop | None = None  # a turn's sampling loop, run on by the engine thread after each step
    result: Any = None  # the logits [S, V] f32, or the loop's TurnEnd
    error: BaseException | None = None
    settled: bool = False

    def settle(self, result: Any, error: BaseException | None = None) -> None:
        self.result, self.error, self.settled = result, error, True

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        assert self.settled  # settled before the asker was woken
        return self.result


class StepBatcher:
    """The engine thread and its queue of forwards."""

    def __init__(self, model: Any, baton: DecoderBaton, *, max_batch: int = 64, gather_s: float = GATHER_S,
                 max_prefill_tokens: int = MAX_PREFILL_TOKENS,
                 on_forward: Callable[[str, int, float], None] | None = None) -> None:
        self.model, self.baton = model, baton
        self.max_batch, self.gather_s = max_batch, gather_s
        self.max_prefill_tokens = max_prefill_tokens
        self.on_forward = on_forward  # called with ("step" | "prefill", sessions, seconds) of each forward
        self._cond = threading.Condition()
        self._queue: list[_Work] = []
        self._in_turn = 0  # turns in flight (each will ask for a forward again soon)
        self._asked_at = 0.0  # when a turn last asked (time.monotonic)
        self._stopped = False
        self.steps = 0
        self.commits = GroupCommit(max_batch)  # the loops' mid-turn commits, one group per pass
        self.thread = threading.Thread(target=self._run, name="coli-engine", daemon=True)
        self.thread.start()

    # ---- the turns' side -------------------------------------------------------------------
    def turn_started(self) -> None:
        with self._cond:
            self._in_turn += 1

    def turn_ended(self) -> None:
        with self._cond:
            self._in_turn -= 1
            self._cond.notify_all()

    def forward(self, tokens: np.ndarray, cache: Any) -> np.ndarray:
        """``model.forward(tokens, cache)`` run by the engine thread (a prompt of several tokens in
        chunks, beside other sessions' steps): the logits of its LAST position, [1, V] f32. The
        caller holds the baton, which it lets go of while it waits."""
        if threading.current_thread() is self.thread or self._stopped:
            out: np.ndarray = self.model.forward(tokens, cache)[-1:]  # [1, V] f32
            return out
        logits: np.ndarray = self._ask(_Work(np.asarray(tokens), cache))
        return logits

    def drive_decode(self, loop: DecodeLoop, cache: Any) -> TurnEnd:
        """Run a turn's decode loop: its first token is taken here, then the engine thread runs
        the loop on between steps (each step's logits sent in, the token it yields stepped next);
        the caller, a turn holding the baton, wakes once the loop has ended (or raised). Any other
        caller, or a stopped batcher: the loop runs here, one ``forward`` per token."""
        if threading.current_thread() is self.thread or self._stopped or not self.baton.held_by_me():
            return drive_inline(self, cache, loop)
        try:
            token = next(loop)
        except StopIteration as done:
            end: TurnEnd = done.value
            return end
        end = self._ask(_Work(np.asarray([token], dtype="<i4"), cache, loop=loop))
        return end

    def _ask(self, work: _Work) -> Any:
        """Queue ``work`` for the engine thread and wait for its outcome."""
        if self.baton.held_by_me():  # a turn: let go of the baton; woken holding it, its forward done
            work.ticket = self.baton.park()
        else:
            work.finished = threading.Event()
        with self._cond:
            self._queue.append(work)
            self._asked_at = time.monotonic()
            if len(self._queue) == 1 or self._complete():  # else the engine sleeps on: no wake-up per turn
                self._cond.notify_all()
        if work.ticket is not None:
            self.baton.wait(work.ticket)
        else:
            assert work.finished is not None
            work.finished.wait()
        return work.outcome()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self.thread.join()
        self.commits.close()

    # ---- the engine thread ------------------------------------------------------------------
    def _complete(self) -> bool:
        """Every turn in flight waits for the step (or a full batch does); under ``_cond``."""
        return len(self._queue) >= min(self._in_turn, self.max_batch)

    def _take(self) -> list[_Work] | None:
        """Wait for work; then until every turn in flight waits, or no turn has asked for
        ``gather_s`` (the turns hand in their next tokens one after another; one that is busy,
        committing say, is not waited for). Woken by the first ask and by the one that completes
        the batch; the asks between only move the deadline (``gather_s`` after the later of the
        last ask and this thread's wake-up)."""
        with self._cond:
            while not self._queue and not self._stopped:
                self._cond.wait()
            if not self._queue:
                return None
            woke = time.monotonic()  # a late wake-up (a loaded machine) still gives the others gather_s
            while not self._complete() and not self._stopped:
                left = max(self._asked_at, woke) + self.gather_s - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            taken, self._queue = self._queue, []
            return taken

    def _run(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            batch, later = self._plan(taken)
            if later:
                with self._cond:
                    self._queue[:0] = later  # first in line for the next step
            self._step(batch)

    def _plan(self, taken: list[_Work]) -> tuple[list[tuple[_Work, int]], list[_Work]]:
        """One step's members, each with the tokens it steps (1, or a prompt's next chunk), and
        what waits for a later step: at most ``max_batch`` members, prompts in arrival order, and
        at most ``max_prefill_tokens`` prompt tokens while any member decodes (the budget keeps the
        running streams flowing); a step with no one decoding takes up to ``IDLE_PREFILL_TOKENS``."""
        batch: list[tuple[_Work, int]] = []
        later: list[_Work] = []
        decoding = any(work.tokens.shape[0] - work.fed == 1 for work in taken)
        budget = self.max_prefill_tokens if decoding else max(self.max_prefill_tokens, IDLE_PREFILL_TOKENS)
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

    def _solo(self, work: _Work, count: int) -> None:
        """Step ``work``'s next ``count`` tokens alone (a batched step that raised)."""
        try:
            t0 = time.perf_counter()
            logits = self.model.step([work.cache], work.tokens[work.fed : work.fed + count], [count])
            self._observe("step" if count == 1 else "prefill", 1, time.perf_counter() - t0)
        except BaseException as exc:  # the turn that asked re-raises it
            work.settle(None, exc)
            self._admit(work)
            return
        self._stepped([(work, count)], logits)

    def _deliver(self, done: list[_Work], logits: np.ndarray) -> None:
        """Row b of ``logits`` [B, V] is ``done[b]``'s: a plain forward is settled and its asker
        woken; a decode loop is run on to its next token (queued for the next step) or its end.
        The loops touch their sessions, so this thread holds the baton while it runs them, as
        their turns would."""
        if any(work.loop is not None for work in done):
            with self.baton.held():
                self._settle_all(done, logits)
        else:
            self._settle_all(done, logits)

    def _settle_all(self, done: list[_Work], logits: np.ndarray) -> None:
        woken: list[_Work] = []
        for b, work in enumerate(done):
            if work.loop is None:
                work.settle(logits[b : b + 1])  # [1, V] f32, as forward returns
            else:
                with self.commits.collecting(work):
                    if self._run_on(work, logits[b]):
                        continue
            woken.append(work)
        self.commits.start_all()  # they run while the next step computes; each loop waits for its own
        for work in woken:  # in batch order
            self._admit(work)

    def run_commit(self, commit: Callable[[], object], *, overlap: bool = False) -> None:
        """A turn's mid-turn commit (the part a session's ``commit_runner`` is handed, which
        touches neither the cache nor the pending token): started at the end of this pass when
        the engine thread is running the turn's loop on (:mod:`.group_commit`), else run now.
        A turn that commits on its own thread (its loop has ended) lets go of the baton while it
        does, and is not waited for by the steps meanwhile: its fsyncs hold no other session back.
        Nothing else touches its session then (the session is claimed by the turn; the engine
        thread runs only other sessions' loops). ``overlap``: the loop may run on while the
        commit is in flight (its session guards its writer: :meth:`GroupCommit.ready`)."""
        if self.commits.put_off(commit, overlap=overlap):
            return
        if threading.current_thread() is self.thread or not self.baton.held_by_me():
            commit()
            return
        self.baton.release()
        self.turn_ended()
        try:
            commit()
        finally:
            self.baton.acquire()
            self.turn_started()

    def _run_on(self, work: _Work, logits: np.ndarray) -> bool:
        """Send a loop its logits [V]: True once it yielded its next token (queued for the next
        step), False once it ended or raised (settled)."""
        assert work.loop is not None
        failed = self.commits.ready(work)  # the commit its last pass asked for, run beside this step
        if failed is not None:  # its turn ends as it would have before the step: the step is undone
            work.cache.truncate(work.cache.length - 1)
            work.settle(None, failed)
            return False
        try:
            token = work.loop.send(logits)
        except StopIteration as done:
            work.settle(done.value)
            return False
        except BaseException as exc:  # a stop, a commit's failure: its turn re-raises it
            work.settle(None, exc)
            return False
        work.tokens, work.fed = np.asarray([token], dtype="<i4"), 0  # [1] i32
        with self._cond:
            self._queue.append(work)
            self._asked_at = time.monotonic()
        return True

    def _admit(self, work: _Work) -> None:
        """The forward is done (settled): its turn may have the baton again (in the order forwards
        finish); another caller is woken. A commit its loop asked for last is waited for first
        (its failure is the turn's error): a turn never finds its commit unfinished."""
        failed = self.commits.wait(work)
        if failed is not None:
            work.settle(None, failed)
        if work.ticket is not None:
            self.baton.admit(work.ticket)
        elif work.finished is not None:
            work.finished.set()

    def _observe(self, kind: str, sessions: int, seconds: float) -> None:
        if self.on_forward is not None:
            self.on_forward(kind, sessions, seconds)

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
        self._observe("step" if min(counts) == 1 else "prefill", len(ready), took)
        self._stepped(ready, logits)

    def _stepped(self, ready: list[tuple[_Work, int]], logits: np.ndarray) -> None:
        """After a step: a prompt with chunks left waits for the next step (first in line); every
        other member gets its row of ``logits`` [B, V] (:meth:`_deliver`)."""
        done: list[_Work] = []
        rows: list[int] = []
        unfinished: list[_Work] = []
        for b, (work, count) in enumerate(ready):
            work.fed += count
            if work.fed < work.tokens.shape[0]:
                unfinished.append(work)
            else:
                done.append(work)
                rows.append(b)
        if unfinished:
            with self._cond:
                self._queue[:0] = unfinished
        if done:
            self._deliver(done, logits[np.asarray(rows)])


class BatchingDecoder:
    """The model as turns see it: every attribute is the decoder's, but ``forward`` goes through
    the engine thread (:class:`StepBatcher`)."""

    def __init__(self, model: Any, batcher: StepBatcher) -> None:
        self._model, self._batcher = model, batcher

    def forward(self, tokens: np.ndarray, cache: Any) -> np.ndarray:
        """The logits of the last of ``tokens``' positions, [1, V] f32 (:meth:`StepBatcher.forward`)."""
        return self._batcher.forward(tokens, cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


__all__ = ["GATHER_S", "MAX_PREFILL_TOKENS", "BatchingDecoder", "StepBatcher"]
