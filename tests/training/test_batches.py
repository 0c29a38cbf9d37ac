"""training.train_glm_mini.Batches: long windows are full of real tokens (no padding), and a chat
stays on one topic across its turns (issue 37 part 5: multi-turn chats for long windows)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from training.corpus import chat_pairs, load_corpus

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "glm-mini"


@pytest.fixture(scope="module")
def batches() -> Any:
    import tokenizers  # the text extra (the README's install has it; absent, this fails: never skipped)

    from training.train_glm_mini import Batches  # imports torch: the oracle extra

    tok = tokenizers.Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    return Batches(tok, load_corpus(), 1024, chat_frac=1.0, seed=3)


def test_chat_windows_are_full_and_start_with_a_chat(batches: Any) -> None:
    inputs, labels = batches.next(2)
    assert tuple(inputs.shape) == (2, 1024) and bool((inputs == labels).all())
    gmask = batches.ids["[gMASK]"]
    assert all(int(row[0]) == gmask for row in inputs)  # each window opens with a chat's first token
    assert all(int((row == gmask).sum()) >= 2 for row in inputs)  # ~100 tokens a turn: more chats follow
    short, _ = batches.next(3, 256)
    assert tuple(short.shape) == (3, 256)


def test_a_chat_keeps_to_one_topic(batches: Any) -> None:
    topics = {name: {a for _, a in chat_pairs({name: text})} for name, text in load_corpus().train_topics.items()}
    for _ in range(8):
        text = batches.tok.decode(batches.chat_sample(), skip_special_tokens=False)
        answers = [part.split("<|user|>")[0].strip() for part in text.split("<|assistant|>")[1:]]
        answers = [a.removesuffix("<|endoftext|>").strip() for a in answers]
        assert answers and any(set(answers) <= pool for pool in topics.values()), answers
