"""A prompt is fed in ONE forward (a server's engine loop runs it as one step, not its head and then
its last token as a second): the last position's logits and every row are bitwise those of the split
the feed used to make, for every kv dtype."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels.model import load_model
from sessionstore.sessions.turn_loop import feed_chunk
from tests.support.session_util import write_tiny_checkpoint

PROMPT = np.asarray(list(b"a prompt of some length, fed at once"), dtype="<i4")  # [S] i32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-ckpt"))


class Counting:
    """The model with its forwards counted."""

    def __init__(self, model: Any) -> None:
        self.model, self.forwards = model, 0

    def forward(self, tokens: np.ndarray, cache: Any) -> np.ndarray:
        self.forwards += 1
        return np.asarray(self.model.forward(tokens, cache))


@pytest.mark.parametrize("kv", ["f32", "fp8"])
def test_a_prompt_is_one_forward_bitwise_the_split(model: Any, kv: str, tmp_path: Path) -> None:
    counting, cache = Counting(model), model.new_cache(kv)
    rows = []
    logits = feed_chunk(counting, cache, PROMPT, on_rows=lambda: rows.append(cache.length))  # type: ignore[arg-type]
    assert counting.forwards == 1 and rows == [PROMPT.size]
    split = model.new_cache(kv)
    model.forward(PROMPT[:-1], split)
    last = model.forward(PROMPT[-1:], split)[-1]  # [V] f32: the last token as a step of its own
    assert logits.tobytes() == last.tobytes()
    ours, theirs = cache.records_since(0), split.records_since(0)
    for name, value in vars(ours).items():  # every row the same too
        other = getattr(theirs, name)
        assert (value is None and other is None) or np.asarray(value).tobytes() == np.asarray(other).tobytes(), name
