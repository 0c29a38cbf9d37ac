"""Conversations in sessions: token-exact against the uninterrupted in-memory run across suspends,
regenerate, edit and fork; the conversation file agrees with the committed tokens after a crash at
every step of a turn (before the truncate, between truncate and the prompt's commit, mid-reply)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers", reason="the text extra (tokenizers) builds the test tokenizer")

from kernels.errors import FormatError, LimitError
from kernels.model.sampling import Sampler
from kernels.model.text import load_text
from sessionstore.sessions import (
    SessionOptions,
    SessionStore,
)
from sessionstore.sessions.commit_state_page import state_path
from sessionstore.sessions.conversation_chat import (
    Conversation,
    ConversationMismatchError,
    ReferenceChat,
)
from sessionstore.sessions.conversation_file import CONVERSATION_NAME, read_record, tokens_digest
from sessionstore.sessions.manifest import MANIFEST_NAME
from tests.kernels.model.text.textkit import write_text_model
from tests.support.conversation_cut import Crash, respond_until_crash


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_model(tmp_path_factory.mktemp("conv-model"), "glm")


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _open(root: Path, sid: str, model_dir: Path, kv: str = "fp8", every: int = 3) -> tuple[Any, Conversation]:
    store = SessionStore(root)
    if store.exists(sid):
        s = store.open(sid, options=SessionOptions(commit_every=every))
    else:
        s = store.create(sid, str(model_dir), kv_dtype=kv, options=SessionOptions(commit_every=every))
    try:
        return s, Conversation.open(s, load_text(model_dir))
    except BaseException:
        s.close()
        raise


@pytest.mark.parametrize("kv,style,sampled", [("f32", "glm", False), ("fp8", "glm", True),
                                              ("fp8", "chatml", False), ("f32", "chatml", True)])
def test_turns_exact_across_suspend_regenerate_edit_fork(tmp_path: Path, kv: str, style: str,
                                                         sampled: bool) -> None:
    model_dir = write_text_model(tmp_path / "model", style)
    tok = load_text(model_dir)
    sampler = Sampler(temperature=0.8, top_k=40, top_p=0.95, seed=99) if sampled else Sampler()
    s = SessionStore(tmp_path).create("a", str(model_dir), kv_dtype=kv, sampler=sampler,
                                      options=SessionOptions(commit_every=3))
    conv = Conversation.open(s, tok)
    ref = ReferenceChat(s.model, tok, kv, sampler)
    msgs: list[dict[str, str]] = [{"role": "system", "content": "Be brief."}]

    def turn(messages: list[dict[str, str]], max_new: int, got: Any) -> list[dict[str, str]]:
        want = ref.respond(messages, max_new)
        assert got.tokens == want
        return [*messages, {"role": "assistant", "content": tok.decode(want)}]

    pieces: list[str] = []
    r = conv.respond([*msgs, _user("Hello there \u4e2d\u6587")], 14, on_text=pieces.append)
    assert "".join(pieces) == r.text == conv.messages[-1]["content"]
    msgs = turn([*msgs, _user("Hello there \u4e2d\u6587")], 14, r)
    msgs = turn([*msgs, _user("What is the capital?")], 9, conv.say("What is the capital?", 9))
    s.suspend()  # between turns: the next one resumes from disk
    s, conv = _open(tmp_path, "a", model_dir)
    assert conv.messages == msgs
    msgs = turn(msgs[:-1], 9, conv.regenerate(9))
    r = conv.edit(1, "Hi instead", 7)  # an earlier message: truncated exactly at the first difference
    assert r.reused_prefix < len(tok.chat_ids(msgs[:1] + [_user("Hi")]))
    msgs = turn([msgs[0], _user("Hi instead")], 7, r)
    conv.fork("b")
    s.close()
    sb, cb = _open(tmp_path, "b", model_dir)
    assert cb.messages == msgs
    msgs = turn([*msgs, _user("in the fork")], 8, cb.say("in the fork", 8))
    assert read_record(sb.directory).agrees_with(sb.history())
    sb.close()
    sa, ca = _open(tmp_path, "a", model_dir)  # the source kept its conversation
    assert ca.messages == msgs[:-2]
    sa.close()


def _crash_run(root: Path, model_dir: Path, where: str) -> tuple[list[dict[str, str]], list[int]]:
    """One complete turn, then a second one crashing at ``where``; returns (messages of the
    complete turn, prompt ids of the second)."""
    s, conv = _open(root, "c", model_dir, every=2)
    conv.say("Hello there", 6)
    before = conv.messages
    second = [*before, _user("Caf\u00e9?")]
    prompt = conv.tokenizer.chat_ids(second)
    if where == "before_truncate":
        s.truncate = _raiser()  # type: ignore[method-assign]
        s.append_tokens = _raiser()  # type: ignore[method-assign]
        second = [_user("Different start")]  # forces a truncate
        prompt = conv.tokenizer.chat_ids(second)
    elif where == "after_truncate":
        s.append_tokens = _raiser()  # type: ignore[method-assign]
        second = [_user("Different start")]
        prompt = conv.tokenizer.chat_ids(second)
    respond_until_crash(conv, second, 40)
    return before, prompt


def _raiser() -> Any:
    def fail(*a: Any, **k: Any) -> Any:
        raise Crash()
    return fail


@pytest.mark.parametrize("where", ["before_truncate", "after_truncate", "mid_reply"])
def test_crash_leaves_messages_that_agree(tmp_path: Path, model_dir: Path, where: str) -> None:
    before, prompt = _crash_run(tmp_path, model_dir, where)
    assert read_record(SessionStore(tmp_path).session_dir("c")).turn is not None  # the crash left it open
    s, conv = _open(tmp_path, "c", model_dir)
    history = s.history()
    rec = read_record(s.directory)
    assert rec.turn is None and rec.agrees_with(history)
    if where == "before_truncate":
        assert conv.recovered["action"] == "dropped" and conv.messages == before
    elif where == "after_truncate":
        assert conv.recovered["action"] == "completed" and history == prompt
        assert conv.messages[-1] == {"role": "assistant", "content": ""}
    else:
        reply = conv.recovered["reply_tokens"]
        assert conv.recovered["action"] == "closed" and history == prompt + reply
        assert 1 <= len(reply) <= 7 and conv.messages[-1]["content"] == conv.tokenizer.decode(reply)
    s.close()


@pytest.mark.parametrize("where", ["before_truncate", "after_truncate", "mid_reply"])
def test_crash_then_exact_continuation(tmp_path: Path, model_dir: Path, where: str) -> None:
    """After a crash at any step, the next turn equals the uninterrupted run of the turns as the
    recovered conversation holds them (a dropped turn absent, a cut reply cut)."""
    tok = load_text(model_dir)
    _crash_run(tmp_path, model_dir, where)
    s, conv = _open(tmp_path, "c", model_dir)
    cut = conv.recovered["reply_tokens"]
    ref = ReferenceChat(s.model, tok, "fp8")
    first = ref.respond([_user("Hello there")], 6)
    msgs = [_user("Hello there"), {"role": "assistant", "content": tok.decode(first)}]
    if where == "mid_reply":
        msgs.append(_user("Caf\u00e9?"))
    elif where == "after_truncate":
        msgs = [_user("Different start")]
    if where != "before_truncate":
        assert ref.respond(msgs, len(cut)) == cut
        msgs.append({"role": "assistant", "content": tok.decode(cut)})
    assert conv.messages == msgs
    assert conv.say("And then?", 9).tokens == ref.respond([*msgs, _user("And then?")], 9)
    s.close()


def test_refusals_change_nothing(tmp_path: Path, model_dir: Path) -> None:
    s, conv = _open(tmp_path, "r", model_dir)
    conv.say("Hello", 4)
    raw = (s.directory / CONVERSATION_NAME).read_bytes()
    history = s.history()
    context = s.model.config.max_position_embeddings
    with pytest.raises(LimitError, match="past the model's context"):
        conv.say("word " * context, 4)
    with pytest.raises(FormatError):
        conv.respond([{"role": "wizard", "content": "x"}], 4)  # the template raises
    with pytest.raises(FormatError):
        conv.respond([{"role": "user", "content": 5}], 4)
    assert s.history() == history and (s.directory / CONVERSATION_NAME).read_bytes() == raw
    s.close()


def test_disagreeing_or_damaged_file_is_refused(tmp_path: Path, model_dir: Path) -> None:
    s, conv = _open(tmp_path, "d", model_dir)
    conv.say("Hello", 4)
    s.generate([1, 2, 3], 2)  # token-level change behind the conversation's back
    s.close()
    with pytest.raises(ConversationMismatchError, match="not its"):
        _open(tmp_path, "d", model_dir)
    path = SessionStore(tmp_path).session_dir("d") / CONVERSATION_NAME
    obj = json.loads(path.read_text())
    obj["digest"] = "zz"
    path.write_text(json.dumps(obj))
    with pytest.raises(FormatError, match="digest"):
        _open(tmp_path, "d", model_dir)
    path.write_bytes(b"\xff{")
    with pytest.raises(FormatError, match="not valid JSON"):
        _open(tmp_path, "d", model_dir)


def test_digest_is_of_int32_ids() -> None:
    import hashlib

    import numpy as np

    assert tokens_digest([1, 258]) == hashlib.sha256(np.array([1, 258], "<i4").tobytes()).hexdigest()


def test_reply_stops_at_any_eos_id(tmp_path: Path, model_dir: Path) -> None:
    """A reply ends at the first token in the tokenizer's eos set (whichever file listed it)."""
    tok = load_text(model_dir)
    s, conv = _open(tmp_path, "e", model_dir)
    free = ReferenceChat(s.model, tok, "fp8")
    free.eos = frozenset()
    msgs = [_user("Hello there")]
    run = free.respond(msgs, 12)
    stop_id = run[4]
    conv.eos = frozenset({stop_id})
    r = conv.respond(msgs, 12)
    assert r.stopped == "eos" and r.tokens == run[:run.index(stop_id) + 1]
    assert s.history()[-1] == stop_id and s.pending == [stop_id]  # sampled, not fed: the pending token
    s.close()


def test_store_fork_carries_the_conversation_only_when_it_describes_the_copy(tmp_path: Path,
                                                                             model_dir: Path) -> None:
    """SessionStore.fork (and so every fork) copies conversation.json with a whole-history copy,
    and leaves it out of a fork cut inside the conversation."""
    s, conv = _open(tmp_path, "src", model_dir)
    conv.say("Tell me something.", 6)
    messages = conv.messages
    s.close()
    store = SessionStore(tmp_path)
    whole = store.fork("src", "whole")
    cut = store.fork("src", "cut", at=whole.tokens - 3)
    copied = read_record(store.session_dir("whole"))
    assert copied is not None and copied.messages == messages and copied.agrees_with(store.history("whole"))
    assert read_record(store.session_dir(cut.id)) is None


def test_a_turns_own_sampler_is_recorded_and_survives_a_crash(tmp_path: Path, model_dir: Path) -> None:
    """``respond(sampler=...)`` draws this turn with it, leaves the manifest's as it was, and the
    file records it (open turn and closed); recovery of a cut turn keeps it; the reply (cut or
    whole) is the uninterrupted run's under it."""
    drawn = Sampler(temperature=0.9, top_p=0.95, seed=123456789)
    tok = load_text(model_dir)
    s, conv = _open(tmp_path, "t", model_dir)
    whole = conv.respond([_user("Hello there")], 8, sampler=drawn).tokens
    assert read_record(s.directory).sampler == drawn and s.manifest.sampler == Sampler()
    assert ReferenceChat(s.model, tok, "fp8", drawn).respond([_user("Hello there")], 8) == whole
    msgs = [_user("Hello there"), {"role": "assistant", "content": tok.decode(whole)}, _user("More?")]
    calls = {"n": 0}

    def crash_at_fifth() -> bool:
        calls["n"] += 1
        if calls["n"] == 5:
            assert read_record(s.directory).turn.sampler == drawn  # recorded before the prompt is fed
            raise Crash()
        return False

    with pytest.raises(Crash):
        conv.respond(msgs, 8, sampler=drawn, should_stop=crash_at_fifth)
    s.abandon()
    s, conv = _open(tmp_path, "t", model_dir)
    record = read_record(s.directory)
    assert conv.recovered["action"] == "closed" and record.sampler == drawn
    assert s.manifest.sampler == Sampler()
    cut = conv.recovered["reply_tokens"]
    ref = ReferenceChat(s.model, tok, "fp8", drawn)
    ref.respond(msgs[:1], 8)
    assert ref.respond(msgs, 8)[:len(cut)] == cut
    s.close()
    path = SessionStore(tmp_path).session_dir("t") / CONVERSATION_NAME
    obj = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in obj.items() if k != "sampler"}))  # a file written before it
    assert read_record(path.parent).sampler is None
    path.write_text(json.dumps({**obj, "sampler": {"temperature": -1, "top_k": 0, "top_p": 1.0, "seed": 0}}))
    with pytest.raises(FormatError, match="sampler"):
        read_record(path.parent)


def test_a_turns_processing_and_response_format_are_recorded_through_a_crash(tmp_path: Path,
                                                                             model_dir: Path) -> None:
    """The turn's logits-processing settings and its response_format go into the open turn and the
    closed record (FORMAT.md 5.8); recovery of a cut turn keeps both; a bad one in the file is refused."""
    drawn = Sampler.checked(0.7, 0, 1.0, 9, presence_penalty=1.0, repetition_penalty=1.2, logit_bias={"7": -3},
                            min_tokens=2)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    s, conv = _open(tmp_path, "f", model_dir)
    conv.respond([_user("Hello there")], 6, sampler=drawn, response_format=fmt)
    record = read_record(s.directory)
    assert record.sampler == drawn and record.response_format == fmt
    calls = {"n": 0}

    def crash_at_third() -> bool:
        calls["n"] += 1
        if calls["n"] == 3:
            raise Crash()
        return False

    msgs = [*record.messages, _user("More?")]
    with pytest.raises(Crash):
        conv.respond(msgs, 6, sampler=drawn, response_format=fmt, should_stop=crash_at_third)
    s.abandon()
    s, conv = _open(tmp_path, "f", model_dir)
    record = read_record(s.directory)
    assert conv.recovered["action"] == "closed" and record.sampler == drawn and record.response_format == fmt
    s.close()
    path = SessionStore(tmp_path).session_dir("f") / CONVERSATION_NAME
    obj = json.loads(path.read_text())
    path.write_text(json.dumps({**obj, "response_format": "json"}))
    with pytest.raises(FormatError, match="response_format"):
        read_record(path.parent)


def test_a_recovered_pending_token_is_drawn_with_the_turns_own_settings(tmp_path: Path, model_dir: Path) -> None:
    """A chat turn drawn with its own settings (an API turn: the manifest keeps greedy), then the
    state page lost, so opening recovers the manifest from the file and draws the pending token
    again: with the turn's recorded settings, not the manifest's, so the session's next turn is the
    one the uninterrupted session gives."""
    drawn = Sampler(temperature=5.0, seed=17)  # flat: its draw is not the greedy one
    first = [_user("Tell me about the sea and the wind.")]
    replies = {}
    for sid in ("cut", "kept"):
        s, conv = _open(tmp_path, sid, model_dir, every=2)
        replies[sid] = conv.respond(first, 12, sampler=drawn, stop_at_eos=False)
        s.close()
    assert replies["cut"].tokens == replies["kept"].tokens
    store = SessionStore(tmp_path)
    assert store.read_manifest("cut").sampler == Sampler()  # the turn's settings were not the manifest's
    state_path(store.session_dir("cut") / MANIFEST_NAME).unlink()  # the page with the pending token: lost
    second = [*first, {"role": "assistant", "content": replies["cut"].text}, _user("And then?")]
    pending, answers = {}, {}
    for sid in ("cut", "kept"):
        s, conv = _open(tmp_path, sid, model_dir, every=2)
        if sid == "cut":
            assert s.resume_report["recovered"] is True
        pending[sid] = list(s.pending)
        answers[sid] = conv.respond(second, 10, sampler=drawn, stop_at_eos=False).tokens
        s.close()
    assert pending["cut"] == pending["kept"]
    assert answers["cut"] == answers["kept"]
