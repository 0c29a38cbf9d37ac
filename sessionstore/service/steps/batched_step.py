"""The engine loop's batched step: schedule -> ONE ``model.step`` of every forward waiting for it ->
postprocess, on the loop's thread. Postprocess takes the step's logits for every member at once:
a plain forward is handed its row; every running turn (:class:`sessionstore.sessions.RunningTurn`,
plain data, no generator or greenlet per turn) draws its next token from its row (the greedy picks
of every row made in one call for the step, ``kernels.model.sampling.greedy_rows``: a turn whose
draw is plain greedy takes its row's, bitwise its own draw; the others draw from their row),
streams its piece, and is queued for the next step or ends; the mid-turn commits that pass asked
for start together, and an ending turn's job is woken to hand its end commit to the I/O threads.

Every single-token forward (a decode step, or a one-token prompt) of every session joins
(continuous batching: sessions join and leave between steps), and beside them chunks of the prompts
waiting to be prefilled (:mod:`.prefill_pacer`). A request that would fail (a token outside the
vocabulary, a full context) fails alone: it is checked before it joins, and should the batched step
raise, its members are stepped one by one (bitwise the same: ``model.step`` computes every row as a
decode step of that token alone would).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.model.sampling import greedy_rows
from sessionstore.log import get_logger
from sessionstore.service.steps.group_commit import GroupCommit
from sessionstore.service.steps.prefill_pacer import PrefillPacer, plan_step
from sessionstore.sessions import RunningTurn

log = get_logger("service")


@dataclass(eq=False)  # compared by identity (the queue holds each once)
class Forward:
    """One forward asked for (or a running turn's next token), and its outcome: the logits, the
    turn's end or the error, set by the step before its asker runs on (a job: made runnable; a
    caller on another thread: its ``done`` event)."""

    tokens: np.ndarray  # [S] i32
    cache: Any
    fed: int = 0  # tokens of ``tokens`` already stepped (a prompt admitted chunk by chunk)
    job: Any = None  # the loop's job that waits for it (None: a caller on another thread)
    done: threading.Event | None = None  # a caller outside the jobs (a test, a tool) waits on it
    turn: RunningTurn | None = None  # a running turn, advanced by the step's postprocess after each step
    checked: bool = False  # its asker checked its ids and room where they entered: not checked again
    result: Any = None  # the logits [S, V] f32, or the running turn, ended
    error: BaseException | None = None
    settled: bool = False

    def settle(self, result: Any, error: BaseException | None = None) -> None:
        self.result, self.error, self.settled = result, error, True

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        assert self.settled  # settled before the asker ran on
        return self.result


class BatchedStep:
    """The forwards waiting for a step (``queue``, the loop's thread only) and the step that runs
    them; ``on_settled`` is called with each forward once it is settled (its asker runs on)."""

    def __init__(self, model: Any, commits: GroupCommit, pacer: PrefillPacer, *, max_batch: int,
                 max_prefill_tokens: int, on_settled: Callable[[Forward], None],
                 on_forward: Callable[[str, int, float], None] | None = None, whole_prompt_tokens: int = 0) -> None:
        self.model, self.commits, self.pacer = model, commits, pacer
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.whole_prompt_tokens = whole_prompt_tokens  # short prompts taken whole beside decoding (plan_step)
        self.on_settled = on_settled
        self.on_forward = on_forward  # called with ("step" | "prefill", sessions, seconds) of each forward
        self.queue: list[Forward] = []
        self.steps = 0

    def run(self) -> None:
        """One step of what waits (as much of it as :func:`~.prefill_pacer.plan_step` lets in)."""
        batch, self.queue = plan_step(self.queue, self.pacer, self.max_batch, self.max_prefill_tokens,
                                      self.whole_prompt_tokens)
        ready: list[tuple[Forward, int]] = []
        for work, count in batch:  # a request that cannot run fails alone, before the step
            try:
                # a running turn's next token was drawn over the vocabulary's logits and a session's
                # prompt was checked where it entered: only a forward asked of the loop from outside
                # is checked, so that one that cannot run fails alone, not the step of all (should a
                # trusted one fail anyway, model.step refuses and each member is stepped alone)
                if work.fed == 0 and work.turn is None and not work.checked:
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
        self._postprocess(ready, logits)

    def _solo(self, work: Forward, count: int) -> None:
        """Step ``work``'s next ``count`` tokens alone (a batched step that raised)."""
        try:
            t0 = time.perf_counter()
            logits = self.model.step([work.cache], work.tokens[work.fed : work.fed + count], [count])
            self._observe("step" if count == 1 else "prefill", 1, time.perf_counter() - t0)
        except BaseException as exc:  # the job that asked re-raises it
            work.settle(None, exc)
            self._admit(work)
            return
        self._postprocess([(work, count)], logits)

    def _postprocess(self, ready: list[tuple[Forward, int]], logits: np.ndarray) -> None:
        """After a step, for every member at once: a prompt with chunks left waits for the next step
        (first in line); every other member gets its row of ``logits`` [B, V]: a plain forward is
        settled and its asker runs on; a running turn draws its next token (queued for the next
        step) or ends (settled: its job runs on and hands its end commit to the I/O threads)."""
        done: list[tuple[Forward, int]] = []
        unfinished: list[Forward] = []
        for b, (work, count) in enumerate(ready):
            work.fed += count
            if work.fed < work.tokens.shape[0]:
                unfinished.append(work)
            else:
                done.append((work, b))
        self.queue[:0] = unfinished
        admitted: list[Forward] = []
        # every row's greedy pick in one call ([B] i64; -1: none), taken by the plain greedy turns
        picks = greedy_rows(logits) if any(work.turn is not None for work, _ in done) else None
        for work, b in done:
            if work.turn is None or picks is None:
                work.settle(logits[b : b + 1])  # [1, V] f32, as forward returns
            else:
                with self.commits.collecting(work):
                    if self._advance(work, work.turn, logits[b], int(picks[b])):
                        continue
            admitted.append(work)
        self.commits.start_all()  # they run while the next step computes; each turn waits for its own
        for work in admitted:  # in batch order
            self._admit(work)

    def _advance(self, work: Forward, turn: RunningTurn, row: np.ndarray, pick: int) -> bool:
        """Advance ``turn`` with its row of the step's logits [V] and that row's greedy pick: True
        once it drew its next token (queued for the next step), False once it ended or raised
        (settled)."""
        failed = self.commits.ready(work)  # the commit its last pass asked for, run beside this step
        if failed is not None:  # its turn ends as it would have before the step: the step is undone
            work.cache.truncate(work.cache.length - 1)
            work.settle(None, failed)
            return False
        try:
            token = turn.advance(row, pick)
        except BaseException as exc:  # a stop, a commit's failure: its turn re-raises it
            work.settle(None, exc)
            return False
        if token is None:
            work.settle(turn)
            return False
        work.tokens, work.fed = np.asarray([token], dtype="<i4"), 0  # [1] i32
        self.queue.append(work)
        return True

    def _admit(self, work: Forward) -> None:
        """The forward is settled: its asker runs on (``on_settled``, in the order forwards finish).
        A commit its running turn asked for last is waited for first (its failure is the turn's
        error): a turn never finds its commit unfinished."""
        failed = self.commits.wait(work)
        if failed is not None:
            work.settle(None, failed)
        self.on_settled(work)

    def _observe(self, kind: str, sessions: int, seconds: float) -> None:
        if self.on_forward is not None:
            self.on_forward(kind, sessions, seconds)



__all__ = ["BatchedStep", "Forward"]
