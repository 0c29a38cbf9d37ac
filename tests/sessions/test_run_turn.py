"""The one turn (:func:`sessionstore.sessions.run_turn`): its one result's ``end`` says why it ended
(a length, an eos id, a stop string, the caller), and the wire's spellings come from that field."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kernels.model.sampling import Sampler
from sessionstore.sessions import OutputProcessor, TurnEnd, run_turn

VOCAB = 9


class _Cache:
    def __init__(self) -> None:
        self.length = 0
        self.tokens = np.zeros(0, np.int32)


class _Model:
    """A stand-in decoder: after feeding t the argmax is (t + 2) % VOCAB."""

    config = SimpleNamespace(max_position_embeddings=64, eos_token_ids=[8])

    def forward(self, tokens: np.ndarray, cache: _Cache) -> np.ndarray:
        rows = np.zeros((len(tokens), VOCAB), np.float32)  # [S, V] f32
        for s, t in enumerate(tokens):
            cache.length += 1
            rows[s, (int(t) + 2) % VOCAB] = 1.0
        return rows


def _turn(output: OutputProcessor, max_new: int = 6) -> tuple[list[int], TurnEnd]:
    reply = run_turn(output, max_new, Sampler(), prompt=[0], model=_Model(), cache=_Cache())
    assert reply.prompt_tokens == 1 and reply.committed is None and reply.tokens == output.tokens
    return reply.tokens, reply.end


@pytest.mark.parametrize(("output", "want", "end"), [
    (OutputProcessor(), [2, 4, 6, 8, 1, 3], TurnEnd.LENGTH),  # eos ids not given: sampled past
    (OutputProcessor(eos=frozenset({8})), [2, 4, 6, 8], TurnEnd.EOS),
    (OutputProcessor(should_abort=lambda: True), [2], TurnEnd.ABORT),
])
def test_the_one_turn_ends_with_one_field(output: OutputProcessor, want: list[int], end: TurnEnd) -> None:
    assert _turn(output) == (want, end)


def test_the_wire_spellings_come_from_the_end() -> None:
    assert [e.finish_reason for e in TurnEnd] == ["length", "stop", "stop", "abort"]
    assert [e.stopped for e in TurnEnd] == ["limit", "eos", "interrupted", "interrupted"]
    assert TurnEnd("eos") is TurnEnd.EOS and TurnEnd.EOS == "eos"  # one spelling, its value on the wire
