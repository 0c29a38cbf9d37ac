"""Bundles carry a session's rendered conversation (conversation.json, FORMAT.md 5.8 / 6.1): an
export ships it when it describes the snapshot, an import installs it only when it describes the
shipped history, and the chat continues on the other host token-exact."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the text extra (tokenizers) builds the test tokenizer")

from kernels.errors import FormatError
from kernels.model.text import load_text
from sessionstore.migration import (
    export_session,
    migrate,
)
from sessionstore.sessions import (
    SessionOptions,
    SessionStore,
)
from sessionstore.sessions.conversation_chat import Conversation, ReferenceChat
from sessionstore.sessions.conversation_file import ConversationRecord, read_record
from tests.kernels.model.text.textkit import write_text_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_model(tmp_path_factory.mktemp("text-model"), "glm")


def _chat(store: SessionStore, sid: str, model_dir: Path) -> tuple[Conversation, list[int]]:
    s = store.create(sid, str(model_dir), kv_dtype="fp8", options=SessionOptions(commit_every=3))
    conv = Conversation.open(s, load_text(model_dir))
    first = conv.say("Hello there", 8).tokens
    return conv, first


def test_a_moved_session_keeps_its_conversation_and_continues_exactly(tmp_path: Path, model_dir: Path) -> None:
    a = SessionStore(tmp_path / "a")
    conv, first = _chat(a, "c", model_dir)
    messages = conv.messages
    conv.session.close()
    buf = io.BytesIO()
    export_session(a, "c", buf)
    b = SessionStore(tmp_path / "b")
    migrate.import_bundle(b, io.BytesIO(buf.getvalue()), model=str(model_dir))
    moved = read_record(b.session_dir("c"))
    assert moved is not None and moved.messages == messages and moved.agrees_with(b.history("c"))
    s = b.open("c")
    got = Conversation.open(s, load_text(model_dir)).say("And then?", 7).tokens
    s.close()
    ref = ReferenceChat(s.model, load_text(model_dir), "fp8", s.manifest.sampler)
    want_first = ref.respond([{"role": "user", "content": "Hello there"}], 8)
    assert want_first == first
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": messages[-1]["content"]}]
    assert got == ref.respond([*history, {"role": "user", "content": "And then?"}], 7)


def test_import_refuses_a_conversation_of_another_history(tmp_path: Path, model_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    a = SessionStore(tmp_path / "a")
    conv, _ = _chat(a, "c", model_dir)
    conv.session.close()
    a.fork("c", "cut", at=a.info("c").tokens - 4)  # a shorter history
    stale = read_record(a.session_dir("c"))
    assert stale is not None
    (a.session_dir("cut") / "conversation.json").write_bytes(stale.encode())  # claims the longer one
    monkeypatch.setattr(ConversationRecord, "agrees_with", lambda self, history: True)  # a lax exporter
    buf = io.BytesIO()
    export_session(a, "cut", buf)
    monkeypatch.undo()
    b = SessionStore(tmp_path / "b")
    with pytest.raises(FormatError, match="does not describe the session's"):
        migrate.import_bundle(b, io.BytesIO(buf.getvalue()), model=str(model_dir))
    assert b.directory.list() == []


def test_no_conversation_no_file(tmp_path: Path) -> None:
    a = SessionStore(tmp_path / "a")
    s = a.create("t", "tiny", kv_dtype="fp8")
    s.generate([1, 2, 3], 4)
    s.close()
    buf = io.BytesIO()
    export_session(a, "t", buf)
    assert b"conversation.json" not in buf.getvalue()[:4096]
    b = SessionStore(tmp_path / "b")
    migrate.import_bundle(b, io.BytesIO(buf.getvalue()), model="tiny")
    assert read_record(b.session_dir("t")) is None
