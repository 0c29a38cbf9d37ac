"""The engine loop holds running turns as data (:class:`sessionstore.sessions.RunningTurn`): a pass of
N running turns is ONE ``model.step`` followed by a postprocess over every turn, with no switch into
any job's greenlet and no generator per turn; a turn that ends hands its end commit to an I/O thread
while the loop steps the others on."""
from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from typing import Any

import greenlet
import numpy as np

from sessionstore.service.steps.loop import EngineLoop
from sessionstore.sessions import OutputProcessor, RunningTurn, TurnStop, drive_inline
from tests.support.chain_decoder import ChainCache, ChainDecoder, greedy, start_logits

VOCAB = 13


class _Model(ChainDecoder):
    """The stand-in decoder (argmax after feeding t to cache c: (5 t + c.id + c.length) % VOCAB) that
    records each step's rows."""

    def __init__(self) -> None:
        super().__init__(5, VOCAB)
        self.steps: list[int] = []  # rows of each step
        self.running: list[Any] = []  # what the loop's queue held for the next step, after each pass

    def on_step(self, caches: Sequence[ChainCache], counts: Sequence[int]) -> None:
        self.steps.append(len(caches))


def _start(i: int) -> np.ndarray:
    return start_logits(i, VOCAB)  # [V] f32


def _run(n: int, max_new: int, stop_at: dict[int, int], commit_threads: dict[int, str],
         model: _Model, into_running: list[int], into_ended: list[int]) -> dict[int, list[int]]:
    """``n`` turns on one loop; turn i ends at its ``stop_at[i]``-th token (a stop string would,
    by TurnStop) and then runs its end commit through the loop's ``run_commit``. ``into_running``
    gets the turn of every switch into a job whose turn was running (not ended), ``into_ended`` of
    every switch into one whose turn had ended."""
    loop = EngineLoop(model, gather_s=0.3)
    loop.after_pass = lambda: model.running.extend(work.turn for work in loop.batch.queue if work.turn is not None)
    out: dict[int, list[int]] = {}
    turns: dict[Any, tuple[int, RunningTurn]] = {}  # a job's greenlet -> its turn, once it has one

    def trace(event: str, args: Any) -> None:
        if event in ("switch", "throw") and args[1] in turns:
            i, running = turns[args[1]]
            (into_ended if running.ended else into_running).append(i)

    def turn(i: int) -> None:
        if greenlet.gettrace() is None:
            greenlet.settrace(trace)
        cache = ChainCache(i)
        output = OutputProcessor()
        limit = stop_at.get(i)

        def on_step(token: int, position: int, logits: np.ndarray) -> None:
            output.on_token(token, position)
            if limit is not None and len(output.tokens) == limit:
                raise TurnStop("stop")

        running = RunningTurn(cache, _start(i), max_new, greedy, frozenset(), None, on_step)
        turns[greenlet.getcurrent()] = (i, running)
        try:
            loop.drive_decode(running, cache)
        except TurnStop:
            pass
        loop.run_commit(lambda: commit_threads.__setitem__(i, threading.current_thread().name))
        out[i] = output.tokens

    futures = [loop.submit(lambda i=i: turn(i)) for i in range(n)]
    for fut in futures:
        fut.result(20)
    loop.submit(lambda: greenlet.settrace(None)).result(5)
    loop.stop()
    return out


def test_a_pass_of_16_running_turns_is_one_step_and_no_switch_and_an_ending_turn_commits_on_an_io_thread() -> None:
    n, max_new = 16, 6
    model, threads, into_running, into_ended = _Model(), {}, [], []
    stop_at = {3: 2, 7: 4}  # two turns end early (as on a stop string) while the others run on
    out = _run(n, max_new, stop_at, threads, model, into_running, into_ended)
    for i in range(n):  # the tokens are the inline run's, cut where the turn ended
        cache = ChainCache(i)
        tokens = drive_inline(model, cache, RunningTurn(cache, _start(i), max_new, greedy, frozenset(), None,
                                                        None)).tokens
        assert out[i] == tokens[: stop_at.get(i, max_new)]
    # one step a pass for every running turn: 16 rows, 15 once turn 3 ended (its 2nd token, drawn
    # after the 1st step), 14 once turn 7 did (its 4th, after the 3rd); 6 tokens: 5 fed
    assert model.steps[: max_new - 1] == [16, 15, 15, 14, 14]
    # no job was switched into while its turn ran: each pass is step -> postprocess over the data
    assert into_running == []
    assert set(into_ended) == set(range(n))  # the trace saw the jobs run on: each once its turn ended
    # the loop held plain data, no generator: a RunningTurn each, its state in slots
    assert model.running and all(type(turn) is RunningTurn and not inspect.isgenerator(turn)
                                 for turn in model.running)
    assert not hasattr(model.running[0], "__dict__")
    # every turn's end commit ran on an I/O thread, the ones that ended early too
    assert set(threads) == set(range(n)) and all(name.startswith("coli-engine-io") for name in threads.values())


def test_what_a_job_puts_is_sent_before_the_step_it_then_waits_for() -> None:
    """A turn's first piece (drawn in its job from its prompt's logits) is sent before the loop's next
    step, not after it: the loop's ``after_pass`` (the core's outbox flush) runs before each step too."""
    order: list[str] = []
    queued: list[str] = []  # what the job put and no flush has sent yet

    class Recording(_Model):
        def on_step(self, caches: Sequence[ChainCache], counts: Sequence[int]) -> None:
            order.append("step")

    loop = EngineLoop(Recording())

    def flush() -> None:
        if queued:
            order.append(f"sent {' '.join(queued)}")
            queued.clear()

    loop.after_pass = flush

    def turn() -> None:
        queued.append("first-piece")  # as a sink's put on the loop's thread
        loop.forward(np.asarray([1], dtype="<i4"), ChainCache(0))  # the next token's step

    loop.submit(turn).result(10)
    loop.stop()
    assert order == ["sent first-piece", "step"]
