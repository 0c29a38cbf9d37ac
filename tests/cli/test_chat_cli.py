"""``coli-kv chat`` in real processes with piped stdin: several turns with a suspend between them,
a SIGKILL in the middle of a reply (then resume), an edited earlier message, a fork and a Ctrl-C
(SIGINT) mid-reply; every reply token-exact against one uninterrupted in-process run, and the
streamed text equal to the final text and to the conversation file."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers", reason="the text extra (tokenizers) builds the test tokenizer")

from kernels.model import load_model
from kernels.model.text import load_text
from sessionstore.sessions import SessionStore
from sessionstore.sessions.conversation_chat import ReferenceChat
from sessionstore.sessions.conversation_file import read_record
from tests.kernels.model.text.textkit import write_text_model

REPO = Path(__file__).resolve().parents[2]
MAX_NEW = 120
CANDIDATES = ["Tell me a long story about the quick brown fox.", "Describe Paris in detail.",
              "Sessions keep their latent cache on disk?", "Write many words about caf\u00e9s.",
              "What is the capital of France? Explain.", "Hello there, how are you today?",
              "\u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e", "The lazy dog sleeps."]


class Chat:
    """One ``coli-kv chat --json`` process fed line by line."""

    def __init__(self, root: Path, sid: str, model: Path, *extra: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.coli_kv", "chat", "--root", str(root), "--session", sid, "--model",
             str(model), "--json", "--max-new", str(MAX_NEW), "--commit-every", "2", *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=env,
            text=True, encoding="utf-8")
        self.opened = self.event()
        assert self.opened["event"] == "open", self.opened

    def event(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise AssertionError(f"chat ended: rc={self.proc.wait(30)} err={self.proc.stderr.read()}")  # type: ignore[union-attr]
        return json.loads(line)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def turn(self, line: str, *, then: Any = None, after: int = 2) -> tuple[str, dict[str, Any] | None]:
        """Send a message; collect streamed pieces until the reply (``then(proc)`` after ``after`` pieces).

        ``after`` is small: the signal must land before the reply ends, and on a loaded machine this reader
        can fall far behind the chat's stream (a piece read is a piece committed: the stream is durable).
        """
        self.send(line)
        pieces: list[str] = []
        while True:
            ev = self.event()
            if "text" in ev:
                pieces.append(ev["text"])
                if then is not None and len(pieces) == after:
                    if then(self.proc) == "dead":
                        return "".join(pieces), None
            elif "reply" in ev:
                return "".join(pieces), ev["reply"]

    def quit(self) -> str:
        self.send("/quit")
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err
        return out


def _kill(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    return "dead"


def _interrupt(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


class Reference:
    """The uninterrupted run, kept in step with the chat: its own messages and cache."""

    def __init__(self, model: Any, tok: Any) -> None:
        self.model, self.tok = model, tok
        self.chat = ReferenceChat(model, tok, "fp8")
        self.messages: list[dict[str, str]] = []

    def say(self, text: str, max_new: int = MAX_NEW, *, base: list[dict[str, str]] | None = None) -> list[int]:
        msgs = [*(self.messages if base is None else base), _user(text)]
        tokens = self.chat.respond(msgs, max_new)
        self.messages = [*msgs, {"role": "assistant", "content": self.tok.decode(tokens)}]
        return tokens

    def long_message(self) -> str:
        """A candidate whose reply runs the whole MAX_NEW without an eos (a kill lands mid-reply)."""
        for text in CANDIDATES:
            probe = ReferenceChat(self.model, self.tok, "fp8")
            tokens = probe.respond([*self.messages, _user(text)], MAX_NEW)
            if len(tokens) == MAX_NEW:
                return text
        raise AssertionError("no candidate message gives a reply without eos")


@pytest.mark.slow
def test_scripted_chat_is_token_exact(tmp_path: Path) -> None:
    model_dir = write_text_model(tmp_path / "model", "glm")
    root = tmp_path / "store"
    tok = load_text(model_dir)
    ref = Reference(load_model(model_dir), tok)
    streamed: dict[str, list[str]] = {"a": [], "b": []}

    # process 1: three turns with a suspend between the second and third
    chat = Chat(root, "a", model_dir)
    assert chat.opened["created"] is True
    for i, text in enumerate(["Hello there", "What is the capital of France?", "/suspend", "And the dog?"]):
        if text == "/suspend":
            chat.send(text)
            assert chat.event()["event"] == "suspended"
            continue
        pieces, reply = chat.turn(text)
        assert reply is not None and reply["tokens"] == ref.say(text), f"turn {i}"
        assert pieces == reply["text"]
        streamed["a"].append(pieces)
    chat.quit()

    # process 2: SIGKILL in the middle of a reply
    long_text = ref.long_message()
    chat = Chat(root, "a", model_dir)
    assert chat.opened["recovered"] is None and chat.opened["messages"] == 6
    _, reply = chat.turn(long_text, then=_kill)
    assert reply is None

    # process 3: the cut reply is recovered and committed; edit an earlier message; fork
    chat = Chat(root, "a", model_dir)
    recovered = chat.opened["recovered"]
    assert recovered["action"] == "closed"
    cut = recovered["reply_tokens"]
    assert 1 <= len(cut) < MAX_NEW, "the kill did not land mid-reply"
    assert ref.say(long_text, len(cut)) == cut
    assert read_record(SessionStore(root).session_dir("a")).messages == ref.messages
    pieces, reply = chat.turn("/edit 2 What is the capital of Italy?")
    assert reply is not None and reply["tokens"] == ref.say("What is the capital of Italy?", base=ref.messages[:2])
    assert reply["reused_prefix"] < reply["prompt_tokens"] - 1  # truncated at the edit
    streamed["a"] = streamed["a"][:1] + [pieces]
    chat.send("/fork b")
    assert chat.event()["event"] == "open" and chat.event() == {"event": "forked", "from": "a", "session": "b"}
    at_fork = list(ref.messages)
    pieces, reply = chat.turn("Now in the fork")
    assert reply is not None and reply["tokens"] == ref.say("Now in the fork")
    streamed["b"] = [*streamed["a"], pieces]
    chat.quit()

    # process 4: Ctrl-C in the middle of a reply in the fork, then one more turn
    long_b = ref.long_message()
    chat = Chat(root, "b", model_dir)
    pieces, reply = chat.turn(long_b, then=_interrupt)
    assert reply is not None and reply["stopped"] == "interrupted"
    assert 1 <= len(reply["tokens"]) < MAX_NEW and pieces == reply["text"]
    assert reply["tokens"] == ref.say(long_b, len(reply["tokens"]))
    streamed["b"].append(pieces)
    pieces, reply = chat.turn("After the interrupt")
    assert reply is not None and reply["tokens"] == ref.say("After the interrupt")
    streamed["b"].append(pieces)
    chat.quit()

    # on disk: each session's conversation is the reference's, and agrees with its tokens
    store = SessionStore(root)
    for sid, messages in (("a", at_fork), ("b", ref.messages)):
        record = read_record(store.session_dir(sid))
        assert record is not None and record.turn is None and record.messages == messages
        assert record.agrees_with(store.history(sid))
        assert streamed[sid] == [m["content"] for m in messages if m["role"] == "assistant"]


def test_ctrl_c_while_waiting_suspends_and_exits(tmp_path: Path) -> None:
    """SIGINT at the prompt (no reply streaming) ends the chat cleanly: exit 0, the turn committed,
    the next chat finds the conversation whole (nothing to recover)."""
    model_dir = write_text_model(tmp_path / "model", "chatml")
    root = tmp_path / "store"
    chat = Chat(root, "w", model_dir)
    pieces, reply = chat.turn("Hello there")
    assert reply is not None and pieces == reply["text"]
    chat.proc.send_signal(signal.SIGINT)
    out, err = chat.proc.communicate(timeout=60)
    assert chat.proc.returncode == 0, err
    again = Chat(root, "w", model_dir)
    assert again.opened["recovered"] is None and again.opened["messages"] == 2
    assert again.opened["tokens"] == reply["prompt_tokens"] + len(reply["tokens"])
    again.quit()
