"""Short prompts admitted whole beside decoding sessions (:func:`plan_step`'s ``whole_tokens``, the
loop's ``whole_prompt_tokens``): a new turn's few hundred tokens take one step, not a paced chunk a
step behind every other new turn, while long prompts stay paced; a session's tokens do not change."""
from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from sessionstore.service.steps.loop import EngineLoop
from sessionstore.service.steps.prefill_pacer import PROBE_TOKENS, WHOLE_PROMPT_TOKENS, PrefillPacer, plan_step
from sessionstore.sessions.turn_loop import RunningTurn, drive_inline
from tests.support.chain_decoder import ChainCache, ChainDecoder, greedy, start_logits

VOCAB = 13


def _waiting(name: str, length: int, fed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(name=name, tokens=np.zeros(length, np.int32), fed=fed)  # tokens [S] i32


def _plan(taken: list[SimpleNamespace], whole: int) -> tuple[list[tuple[str, int]], list[str]]:
    batch, later = plan_step(taken, PrefillPacer(cap=32), max_batch=64, max_prefill_tokens=32, whole_tokens=whole)
    return [(w.name, n) for w, n in batch], [w.name for w in later]


def test_beside_decoding_short_prompts_go_whole_up_to_the_budget_and_long_ones_stay_paced() -> None:
    taken = [_waiting("d1", 1), _waiting("d2", 1), _waiting("a", 200), _waiting("b", 100), _waiting("c", 50),
             _waiting("long", 1000), _waiting("begun", 100, fed=40)]
    batch, later = _plan(taken, 256)
    # a whole; b (100) does not fit the 56 left and waits whole (not a chunk); c fits; the long one and
    # the one already chunked get the pacer's probe between them
    assert batch == [("d1", 1), ("d2", 1), ("a", 200), ("c", 50), ("long", PROBE_TOKENS)]
    assert later == ["b", "begun"]
    batch, later = _plan([_waiting("d", 1), _waiting("b", 100), _waiting("a", 200)], 256)
    assert batch == [("d", 1), ("b", 100)] and later == ["a"]  # next step, a is first and fits: none starves
    batch, _ = _plan([_waiting("d", 1), _waiting("a", 200)], 0)
    assert batch == [("d", 1), ("a", PROBE_TOKENS)]  # off: paced like any prompt
    batch, later = _plan([_waiting("a", 200), _waiting("b", 100), _waiting("long", 1000)], 256)
    # no one decoding: the long prompt takes the idle budget as before; of the short ones that arrived
    # together, the first goes now and b next step (its first token comes a step later, a's no longer
    # waits for b's prefill)
    assert batch == [("a", 200), ("long", 1000)] and later == ["b"]


class _Model(ChainDecoder):
    """The stand-in decoder (its logits after token t on cache c depend on t, c's id and length: a
    row computed out of order, twice or in the wrong cache changes them); records each step's
    members (cache id, tokens stepped)."""

    def __init__(self) -> None:
        super().__init__(5, VOCAB)
        self.members: list[list[tuple[int, int]]] = []

    def on_step(self, caches: Sequence[ChainCache], counts: Sequence[int]) -> None:
        self.members.append([(c.id, n) for c, n in zip(caches, counts, strict=True)])


def _start(i: int) -> np.ndarray:
    return start_logits(i, VOCAB)  # [V] f32


def _decode(cache: ChainCache, i: int, max_new: int, on_step: Any = None) -> Any:
    return RunningTurn(cache, _start(i), max_new, greedy, frozenset(), None, on_step)


def test_a_short_prompt_beside_running_loops_takes_one_step_and_changes_no_token() -> None:
    prompt_len, loops_new = 200, 120
    model = _Model()
    loop = EngineLoop(model, gather_s=0.3)  # the service's default whole_prompt_tokens
    asked: list[Any] = []

    def turn(i: int) -> Any:
        cache = ChainCache(i)

        def on_step(token: int, position: int, logits: np.ndarray) -> None:
            if i == 0 and position == 5:  # both loops running: a new turn's prompt arrives
                asked.append(loop.submit(lambda: loop.forward(np.arange(prompt_len, dtype=np.int32), ChainCache(9))))

        return loop.drive_decode(_decode(cache, i, loops_new, on_step), cache)

    try:
        outcomes = [fut.result(20) for fut in [loop.submit(lambda i=i: turn(i)) for i in range(2)]]
        got = asked[0].result(10)
    finally:
        loop.stop()
    assert prompt_len <= WHOLE_PROMPT_TOKENS
    alone = _Model().forward(np.arange(prompt_len, dtype=np.int32), ChainCache(9))[-1:]  # [1, V]
    assert np.array_equal(got, alone)
    for i, outcome in enumerate(outcomes):
        cache = ChainCache(i)
        inline = drive_inline(_Model(), cache, _decode(cache, i, loops_new)).tokens
        assert outcome.tokens == inline  # the loops' tokens are unchanged by the prompt beside them
    steps = [dict(step) for step in model.members if 9 in dict(step)]
    assert len(steps) == 1 and steps[0][9] == prompt_len and {0, 1} <= set(steps[0])  # whole, beside both
