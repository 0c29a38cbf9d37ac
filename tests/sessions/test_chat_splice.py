"""A chat turn whose history comes back as text: when the messages up to the last reply are the
session's own, the prompt is the session's ids (the reply as generated) + the rendering's ids of
the new messages, so nothing is truncated or fed again; any other history is prefix-matched as
before. The spliced prompt spells the full rendering's text, its turn is token-exact against a
session fed the same ids, and a crash inside it recovers to the same prompt."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers", reason="the text extra (tokenizers) builds the test tokenizer")

from kernels.model.sampling import Sampler
from kernels.model.text import load_text
from sessionstore.sessions import SessionOptions, SessionStore
from sessionstore.sessions.chat_splice import spelled_end, splice_prompt
from sessionstore.sessions.conversation_chat import Conversation
from sessionstore.sessions.conversation_file import read_record
from sessionstore.sessions.manifest import MANIFEST_NAME
from sessionstore.sessions.turn_loop import common_prefix
from tests.kernels.model.text.textkit import write_text_model
from tests.support.conversation_cut import respond_until_crash

LETTERS = "he"  # single-letter tokens a reply is pushed to: "h" then "e" re-tokenise merged ("he")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_text_model(tmp_path_factory.mktemp("splice-model"), "glm")


def letters_only(tok: Any, *specials: str) -> Sampler:
    """Greedy, every token but the single letters of LETTERS (and ``specials``) pushed far down: a
    reply of valid text spelled one letter a token, which the rendering tokenises otherwise."""
    ids = [tok.encode(c) for c in [*LETTERS, *specials]]
    assert all(len(i) == 1 for i in ids)
    return Sampler(logit_bias=tuple((i, 100.0) for i in sorted({j[0] for j in ids})))


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _epoch(s: Any) -> int:
    return int(json.loads((s.directory / MANIFEST_NAME).read_text())["epoch"])


def _open(root: Path, model_dir: Path, sid: str = "a") -> tuple[Any, Conversation]:
    store = SessionStore(root)
    opts = SessionOptions(commit_every=3)
    s = store.open(sid, options=opts) if store.exists(sid) else store.create(sid, str(model_dir), options=opts)
    return s, Conversation.open(s, load_text(model_dir))


def _first_turn(root: Path, model_dir: Path, *specials: str) -> tuple[Any, Conversation, list[dict[str, str]]]:
    """A session after one turn whose reply re-tokenises to other ids (``specials``: sampled past
    them, their ids in the reply, not in its text); the messages a client then holds."""
    s, conv = _open(root, model_dir)
    tok = conv.tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, _user("hello there")]
    reply = conv.respond(msgs, 12, sampler=letters_only(tok, *specials), stop_at_eos=not specials)
    assert all(any(t == tok.encode(c)[0] for t in reply.tokens[:-1]) for c in specials)  # the premise
    msgs = [*msgs, {"role": "assistant", "content": reply.text}]
    history = s.history()
    assert tok.decode(reply.tokens) == reply.text and "\ufffd" not in reply.text
    assert common_prefix(history, tok.chat_ids([*msgs, _user("x")])) < len(history) - 1  # the premise
    return s, conv, msgs


@pytest.mark.parametrize("specials", [(), ("<|user|>",)])
def test_a_reply_that_retokenises_otherwise_is_kept_as_generated(tmp_path: Path, model_dir: Path,
                                                                 specials: tuple[str, ...]) -> None:
    """Three turns, each sent with the whole history: no truncate, the whole history reused, the
    prompt spells the full rendering and ends with its ids; across a suspend and a reopen. With
    an eos id sampled past inside a reply (``ignore_eos``: the reply's text skips it), the id
    stays in the prompt as in the history, and the texts agree with special tokens skipped."""
    s, conv, msgs = _first_turn(tmp_path, model_dir, *specials)
    tok, epoch = conv.tokenizer, _epoch(s)
    for turn in range(2):
        before = s.history()
        msgs = [*msgs, _user(f"and {turn}?")]
        full = tok.chat_ids(msgs)
        reply = conv.respond(msgs, 10, sampler=letters_only(tok, *specials), stop_at_eos=not specials)
        history = s.history()
        prompt = history[:reply.prompt_tokens]
        assert prompt[:len(before)] == before  # the reply's ids as generated, not re-fed
        assert reply.reused_prefix == len(before) - 1  # every row (the reply's last token was pending)
        assert prompt != full and prompt[len(before):] == full[len(full) - (len(prompt) - len(before)):]
        if specials:  # the same text as the stored replies' (special tokens skipped), the same markers and more
            assert tok.decode(prompt) == tok.decode(full) and tok.decode(prompt, skip_special_tokens=False) != \
                tok.render(msgs)
            assert sum(t in tok.special_ids for t in prompt) > sum(t in tok.special_ids for t in full)
        else:
            assert tok.decode(prompt, skip_special_tokens=False) == tok.render(msgs)  # the same text
        assert _epoch(s) == epoch  # no truncate
        record = read_record(s.directory)
        assert record.turn is None and record.agrees_with(history) and record.messages[:-1] == msgs
        msgs = [*msgs, {"role": "assistant", "content": reply.text}]
        s.suspend()
        s.close()
        s, conv = _open(tmp_path, model_dir)
    s.close()


@pytest.mark.parametrize("edit", ["reply", "earlier", "system"])
def test_an_edited_history_truncates_and_refeeds_as_before(tmp_path: Path, model_dir: Path, edit: str) -> None:
    s, conv, msgs = _first_turn(tmp_path, model_dir)
    tok, epoch = conv.tokenizer, _epoch(s)
    before = s.history()
    if edit == "reply":
        msgs[-1] = {"role": "assistant", "content": msgs[-1]["content"] + " x"}
    elif edit == "earlier":
        msgs[1] = _user("hello there!")
    else:
        msgs[0] = {"role": "system", "content": "Be long."}
    msgs = [*msgs, _user("next")]
    full = tok.chat_ids(msgs)
    reply = conv.respond(msgs, 6)
    assert reply.prompt_tokens == len(full) and s.history()[:len(full)] == full  # the rendering's ids
    assert reply.reused_prefix == common_prefix(before[:-1], full) < len(before) - 1
    assert _epoch(s) == epoch + 1  # truncated at the first difference
    s.close()


def test_the_spliced_turn_equals_a_session_fed_the_same_ids(tmp_path: Path, model_dir: Path) -> None:
    s, conv, msgs = _first_turn(tmp_path, model_dir)
    msgs = [*msgs, _user("go on")]
    reply = conv.respond(msgs, 12, stop_at_eos=False)
    prompt = s.history()[:reply.prompt_tokens]
    assert prompt != conv.tokenizer.chat_ids(msgs)  # spliced
    s.close()
    ref = SessionStore(tmp_path / "ref").create("r", str(model_dir))
    ref.append_tokens(prompt, commit=True)  # the same ids through the Session API, one process
    assert ref.generate(None, 12).tokens == reply.tokens
    ref.close()


def test_a_crash_inside_a_spliced_turn_recovers_its_prompt(tmp_path: Path, model_dir: Path) -> None:
    s, conv, msgs = _first_turn(tmp_path, model_dir)
    before = s.history()
    msgs = [*msgs, _user("more")]
    respond_until_crash(conv, msgs, 20, checks=2)
    turn = read_record(SessionStore(tmp_path).session_dir("a")).turn
    assert turn is not None and turn.spliced == len(before)  # recorded as spliced
    s, conv = _open(tmp_path, model_dir)
    history = s.history()
    assert conv.recovered is not None and conv.recovered["action"] == "closed"
    n = turn.prompt_tokens
    assert history[:len(before)] == before and len(history) >= n > len(before)
    assert tok_text(conv, history[:n]) == conv.tokenizer.render(msgs)
    assert read_record(s.directory).agrees_with(history)
    s.close()


def tok_text(conv: Conversation, ids: list[int]) -> str:
    return conv.tokenizer.decode(ids, skip_special_tokens=False)


def test_special_tokens_compare_as_ids_not_as_their_spelling(model_dir: Path) -> None:
    tok = load_text(model_dir)
    held = [_user("hi"), {"role": "assistant", "content": "a<|user|>"}]
    rendered = tok.chat_ids([*held, _user("b")])
    head = tok.chat_ids([_user("hi")])
    spelled = [*head, *tok.encode("a"), *(t for c in "<|user|>" for t in tok.encode(c))]  # the letters, not id 4
    text = tok.decode(spelled, skip_special_tokens=False)
    assert text.endswith("a<|user|>") and tok.decode(rendered, skip_special_tokens=False).startswith(text)
    assert spelled_end(tok, spelled, rendered) is None
    assert splice_prompt(tok, held, [*held, _user("b")], spelled, rendered) is None
    same = [*head, *tok.encode("a")]  # the text without the marker: the prompt continues at a boundary
    assert spelled_end(tok, same, rendered) == len(same)
