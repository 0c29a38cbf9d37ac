"""A chat turn in durable-stream mode commits its prompt with the commit that covers its first
token (a kv commit of the prompt's records with the token pending, or under ``commit_every``
records a tail commit holding their ids, FORMAT.md 5.5), not by a commit of its own first: one
commit has returned when its first piece leaves, not two. Without durable streaming the prompt is
committed before the reply, as before. Either way the turns reopen exactly."""
from __future__ import annotations

from pathlib import Path

import pytest

from kernels.model.text import load_text
from sessionstore.sessions import SessionOptions, SessionStore
from sessionstore.sessions.conversation_chat import Conversation
from sessionstore.sessions.durable_text import held_until_committed
from tests.kernels.model.text.textkit import write_text_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_model(tmp_path_factory.mktemp("first-commit-model"), "glm")


@pytest.mark.parametrize("durable,every", [(True, 64), (True, 4), (False, 64)])  # 64: a tail commit, 4: a kv one
def test_one_commit_before_the_first_piece(tmp_path: Path, model_dir: Path, durable: bool, every: int) -> None:
    options = SessionOptions(commit_every=every, durable_stream=durable)
    store = SessionStore(tmp_path)
    session = store.create("c", str(model_dir), kv_dtype="fp8", options=options)
    conv = Conversation.open(session, load_text(model_dir))
    msgs = [{"role": "user", "content": "Hello there, a few words of a prompt"}]
    replies = []
    for _ in range(2):  # the second turn on top of the first's history
        committed_at: list[int] = []  # the session's commits returned when each piece left
        pieces: list[str] = []
        start = session.commits.committer.commits

        def emit(piece: str, *_: object, at: list[int] = committed_at, got: list[str] = pieces,
                 start: int = start) -> None:
            at.append(session.commits.committer.commits - start)
            got.append(piece)

        with held_until_committed(session, emit) as hold:
            reply = conv.respond(msgs, 6, on_text=hold)
        assert committed_at and committed_at[0] == 1, committed_at
        assert "".join(pieces) == reply.text
        replies.append(reply.tokens)
        msgs = [*msgs, {"role": "assistant", "content": reply.text}, {"role": "user", "content": "And more?"}]
    history = session.history()
    session.close()
    again = SessionStore(tmp_path).open("c", options=options)
    assert again.history() == history and history[-len(replies[1]):] == replies[1]
    again.close()
