"""``coli-kv chat --durable-stream`` in a real process: SIGKILLed in the middle of a reply, after
several pieces were printed, the reply its next process recovers holds every printed byte (with
``--commit-every 16`` and no flag, the printed text runs ahead of what was committed)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the text extra (tokenizers) builds the test tokenizer")

from kernels.model import load_model
from kernels.model.text import load_text
from tests.cli.test_chat_cli import Chat, Reference, _kill
from tests.kernels.model.text.textkit import write_text_model


def _printed_and_recovered(tmp_path: Path, *flags: str) -> tuple[str, str]:
    model_dir = write_text_model(tmp_path / "model", "glm")
    tok = load_text(model_dir)
    long_text = Reference(load_model(model_dir), tok).long_message()
    root = tmp_path / "store"
    printed, reply = Chat(root, "a", model_dir, "--commit-every", "16", *flags).turn(long_text, then=_kill, after=12)
    assert reply is None  # killed mid-reply
    chat = Chat(root, "a", model_dir)
    recovered = chat.opened["recovered"]
    chat.quit()
    return printed, tok.decode(recovered["reply_tokens"] if recovered else [])


def test_a_killed_durable_chat_recovers_every_printed_byte(tmp_path: Path) -> None:
    printed, recovered = _printed_and_recovered(tmp_path, "--durable-stream")
    assert printed and recovered.startswith(printed), (printed, recovered)


@pytest.mark.slow
def test_without_the_flag_printed_text_runs_ahead_of_the_commit(tmp_path: Path) -> None:
    printed, recovered = _printed_and_recovered(tmp_path, "--no-durable-stream")
    assert not recovered.startswith(printed)
