"""``GET /v1/sessions/{id}?messages=1``: a session's messages, read from its committed files, and only
when they describe the committed tokens. Over a real server: a two-turn chat gives back what was sent
plus the replies; a completions-API session, a chat continued by a completion and a fork cut inside
the conversation give null with the reason; a read during a streamed turn is answered at once. In
process: a read at every piece of a running turn gives the turn's messages and the reply committed so
far; after a crash at each step of a turn the read gives what recovery then writes."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from kernels.model.text import load_text
from sessionstore.service.engine.messages import READ_ATTEMPTS, judge, read_messages
from sessionstore.sessions import SessionOptions, SessionStore
from sessionstore.sessions.conversation_chat import Conversation
from sessionstore.sessions.conversation_file import ConversationRecord, OpenTurn, tokens_digest, write_record
from tests.service.serverkit import ServerProc, sse_events
from tests.support.conversation_cut import Crash, respond_until_crash


def _name(server: ServerProc) -> str:
    return Path(server.model).name  # the model id is the model directory's name


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _chat(server: ServerProc, sid: str, messages: list[dict[str, str]], max_tokens: int = 16) -> str:
    res = server.post("/v1/chat/completions", json={"model": _name(server), "messages": messages,
                                                    "session": sid, "max_tokens": max_tokens})
    assert res.status_code == 200, res.text
    return str(res.json()["choices"][0]["message"]["content"])


def _messages(server: ServerProc, sid: str) -> dict[str, Any]:
    res = server.get(f"/v1/sessions/{sid}", params={"messages": "1"})
    assert res.status_code == 200, res.text
    body: dict[str, Any] = res.json()
    return body


@pytest.fixture
def server(tmp_path: Path, text_model_dir: Path) -> Any:
    with ServerProc(tmp_path / "root", text_model_dir) as proc:
        yield proc


# ---- over a real server ---------------------------------------------------------------------------
def test_two_turns_give_back_what_was_sent_and_the_replies(server: ServerProc) -> None:
    sent = [{"role": "system", "content": "Be brief."}, _user("Hello there, caf\u00e9 \u4e2d\u6587?")]
    sent.append({"role": "assistant", "content": _chat(server, "c", sent)})
    sent.append(_user("And then?"))
    sent.append({"role": "assistant", "content": _chat(server, "c", sent)})
    body = _messages(server, "c")
    assert body["messages"] == sent and body["messages_state"] == "complete" and body["messages_reason"] is None
    assert body["tokens"] > 0 and body["id"] == "c"
    assert "messages" not in server.get("/v1/sessions/c").json()  # only when asked

    fork = server.post("/v1/sessions/c/fork", json={"new": "c.whole"})
    assert fork.status_code == 200, fork.text
    assert _messages(server, "c.whole")["messages"] == sent  # same tokens, same messages
    cut = server.post("/v1/sessions/c/fork", json={"new": "c.cut", "at": 5})
    assert cut.status_code == 200, cut.text
    body = _messages(server, "c.cut")
    assert body["messages"] is None and body["messages_reason"]["code"] == "no_conversation"

    # a completion on the chat's session changes its tokens: its messages are gone, never stale
    res = server.post("/v1/completions", json={"model": _name(server), "prompt": "plain text",
                                               "session": "c", "max_tokens": 4})
    assert res.status_code == 200, res.text
    body = _messages(server, "c")
    assert body["messages"] is None and body["messages_state"] is None
    assert body["messages_reason"]["code"] == "no_conversation"
    assert "completions API" in body["messages_reason"]["message"]


def test_completions_session_has_no_messages(server: ServerProc) -> None:
    res = server.post("/v1/completions", json={"model": _name(server), "prompt": "once upon a time",
                                               "session": "raw", "max_tokens": 6})
    assert res.status_code == 200, res.text
    body = _messages(server, "raw")
    assert body["messages"] is None and body["tokens"] > 0
    assert body["messages_reason"]["code"] == "no_conversation"
    assert server.get("/v1/sessions/nope", params={"messages": "1"}).status_code == 404


def test_read_during_a_streamed_turn_is_answered_at_once(server: ServerProc) -> None:
    sent = [_user("Tell me everything about sessions.")]
    first_piece = threading.Event()
    final: dict[str, Any] = {}

    def stream() -> None:
        body = {"model": _name(server), "messages": sent, "session": "live",
                "max_tokens": 64, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as res:
            for chunk in sse_events(res):
                if chunk["choices"][0].get("delta", {}).get("content"):
                    first_piece.set()
                if chunk["choices"][0].get("finish_reason"):
                    final.update(chunk)
        first_piece.set()

    worker = threading.Thread(target=stream)
    worker.start()
    assert first_piece.wait(120)
    seen = _messages(server, "live")  # 200 while the turn may still run: the read takes no claim
    worker.join(120)
    tokens = final["choices"][0]["token_ids"]
    tok = load_text(server.model)
    assert seen["messages_state"] in ("turn_partial", "complete"), seen
    assert seen["messages"][:-1] == sent
    reply = seen["messages"][-1]
    assert reply["role"] == "assistant"
    assert reply["content"] in {tok.decode(tokens[:j]) for j in range(len(tokens) + 1)}  # a committed prefix
    assert _messages(server, "live")["messages"] == [*sent, {"role": "assistant", "content": tok.decode(tokens)}]


# ---- in process: the rules over real conversation files ---------------------------------------------
def _reader(store: SessionStore, sid: str, tok: Any) -> Any:
    return read_messages(store.session_dir(sid), lambda: store.history(sid), tok.decode)


def test_every_piece_of_a_running_turn_reads_its_committed_prefix(tmp_path: Path, text_model_dir: Path) -> None:
    tok = load_text(text_model_dir)
    store = SessionStore(tmp_path)
    s = store.create("a", str(text_model_dir), kv_dtype="fp8", options=SessionOptions(commit_every=2))
    conv = Conversation.open(s, tok)
    first = conv.say("Hello there", 6)
    before = conv.messages
    reader = SessionStore(tmp_path)  # another store over the same root, as the API's read is
    views: list[Any] = []
    sent = [*before, _user("Tell me more, please.")]
    reply = conv.respond(sent, 14, on_text=lambda piece: views.append(_reader(reader, "a", tok)))
    assert first.tokens and len(reply.tokens) >= 4, "the test needs a reply of several tokens"
    prefixes = {tok.decode(reply.tokens[:j]) for j in range(len(reply.tokens) + 1)}
    assert views and all(v.state == "turn_partial" and v.messages[:-1] == sent for v in views)
    assert all(v.messages[-1]["content"] in prefixes for v in views)
    assert any(v.messages[-1]["content"] for v in views), "no read saw a committed piece of the reply"
    done = _reader(reader, "a", tok)
    assert done.state == "complete" and done.messages == conv.messages == [
        *sent, {"role": "assistant", "content": reply.text}]
    s.close()


def _raiser(*args: Any, **kw: Any) -> Any:
    raise Crash()


@pytest.mark.parametrize("where,state", [("before_truncate", "turn_unfed"), ("after_truncate", None),
                                         ("mid_reply", "turn_partial")])
def test_after_a_crash_the_read_is_what_recovery_writes(tmp_path: Path, text_model_dir: Path, where: str,
                                                        state: str | None) -> None:
    tok = load_text(text_model_dir)
    store = SessionStore(tmp_path)
    s = store.create("c", str(text_model_dir), kv_dtype="fp8", options=SessionOptions(commit_every=2))
    conv = Conversation.open(s, tok)
    conv.say("Hello there", 6)
    second = [*conv.messages, _user("Caf\u00e9?")]
    if where != "mid_reply":
        second = [_user("A different start")]  # forces a truncate
        s.append_tokens = _raiser  # type: ignore[method-assign]
        if where == "before_truncate":
            s.truncate = _raiser  # type: ignore[method-assign]
    respond_until_crash(conv, second, 40)
    view = _reader(SessionStore(tmp_path), "c", tok)
    assert view.state == state
    if state is None:
        assert view.messages is None and view.code == "turn_incomplete"
    s2 = SessionStore(tmp_path).open("c")
    recovered = Conversation.open(s2, tok)  # closes (or drops) the open turn
    if where == "mid_reply":
        assert view.messages == recovered.messages and view.messages[-1]["content"]
    elif where == "before_truncate":
        assert view.messages == recovered.messages
    assert _reader(SessionStore(tmp_path), "c", tok).messages == recovered.messages
    s2.close()


# ---- the rules on hand-made records ----------------------------------------------------------------
def test_judge_refuses_what_does_not_describe_the_history() -> None:
    def decode(ids: list[int]) -> str:
        return ",".join(map(str, ids))
    old = [1, 2, 3]
    msgs = [_user("hi"), {"role": "assistant", "content": "yo"}]
    closed = ConversationRecord(msgs, len(old), tokens_digest(old))
    assert judge(closed, old, decode).messages == msgs
    wrong = judge(closed, [1, 2, 4], decode)
    assert wrong.messages is None and wrong.code == "conversation_mismatch"
    prompt = [1, 2, 9, 9]
    turn = [*msgs, _user("next")]
    open_rec = ConversationRecord(msgs, len(old), tokens_digest(old), OpenTurn(turn, len(prompt),
                                                                               tokens_digest(prompt)))
    assert judge(open_rec, old, decode).state == "turn_unfed"
    partial = judge(open_rec, [*prompt, 7, 8], decode)
    assert partial.messages == [*turn, {"role": "assistant", "content": "7,8"}]
    assert judge(open_rec, prompt, decode).messages == [*turn, {"role": "assistant", "content": ""}]
    assert judge(open_rec, [1, 2, 9], decode).code == "turn_incomplete"
    assert judge(open_rec, [1, 2, 8, 9, 9], decode).code == "conversation_mismatch"
    assert judge(open_rec, [*prompt, 7], None).code == "no_tokenizer"


def test_a_file_rewritten_during_every_read_is_not_judged(tmp_path: Path) -> None:
    history = [5, 6]
    flips = {"n": 0}

    def moving_history() -> list[int]:  # a turn writes the file between the two reads, every time
        flips["n"] += 1
        write_record(tmp_path, ConversationRecord([_user(f"v{flips['n']}")], 2, tokens_digest(history)))
        return history

    write_record(tmp_path, ConversationRecord([_user("v0")], 2, tokens_digest(history)))
    view = read_messages(tmp_path, moving_history, None)
    assert view.messages is None and view.code == "conversation_changing" and flips["n"] == READ_ATTEMPTS
    (tmp_path / "conversation.json").write_text("{not json")
    assert read_messages(tmp_path, lambda: history, None).code == "conversation_unreadable"
