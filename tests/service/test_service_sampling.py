"""Sampling options of chat and text completions over a real server and the ``openai`` client:
log-probabilities (OpenAI's chat shape and the legacy completions shape, streamed and not), checked
against the in-process model's own log-softmax."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kernels.model.logits import log_softmax
from sessionstore.sessions.turns import feed_chunk
from tests.service.serverkit import ServerProc, sse_events

MAX = 12
TOL = 1e-4  # f32 logits through two processes' identical forwards: equal up to f64 rounding


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, text_model_dir: Path) -> Any:
    with ServerProc(tmp_path_factory.mktemp("sampling") / "root", text_model_dir) as proc:
        yield proc


def _name(server: ServerProc) -> str:
    return Path(server.model).name


def _log_softmax_rows(model: Any, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """The in-process model's log-softmax at each drawn position: [len(tokens)] of [V] f64."""
    cache = model.new_cache("fp8")  # the server's default kv dtype
    logits = feed_chunk(model, cache, prompt)  # [V] f32
    rows = []
    for token in tokens:
        rows.append(log_softmax(logits))
        logits = model.forward(np.asarray([token], dtype="<i4"), cache)[-1]  # [V] f32
    return rows


def _top_values(lp: np.ndarray, k: int) -> list[float]:
    return sorted((float(v) for v in lp), reverse=True)[:k]


MSGS = [{"role": "user", "content": "Tell me a story about a fox."}]


def test_chat_logprobs_are_the_models_log_softmax(server: ServerProc, text_model: tuple[Any, Any]) -> None:
    model, tok = text_model
    reply = server.openai().chat.completions.create(model=_name(server), messages=MSGS, max_tokens=MAX,
                                                    logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == len(choice.token_ids) == MAX
    rows = _log_softmax_rows(model, tok.chat_ids(MSGS), choice.token_ids)
    for item, token, lp in zip(content, choice.token_ids, rows, strict=True):
        assert len(item.top_logprobs) == 5
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == item.logprob  # greedy
        assert abs(item.logprob - lp[token]) < TOL
        assert np.allclose([t.logprob for t in item.top_logprobs], _top_values(lp, 5), atol=TOL)
        text, raw = tok.token_text(token)
        assert item.token == text and bytes(item.bytes) == raw


def test_chat_logprobs_without_top_and_when_not_asked(server: ServerProc) -> None:
    client, name = server.openai(), _name(server)
    plain = client.chat.completions.create(model=name, messages=MSGS, max_tokens=4)
    assert plain.choices[0].logprobs is None
    bare = client.chat.completions.create(model=name, messages=MSGS, max_tokens=4, logprobs=True)
    assert [len(i.top_logprobs) for i in bare.choices[0].logprobs.content] == [0] * len(bare.choices[0].token_ids)


def _raw_stream(server: ServerProc, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        return list(sse_events(response))


def test_streamed_chat_logprobs_per_chunk_equal_the_whole(server: ServerProc) -> None:
    body = {"model": _name(server), "messages": MSGS, "max_tokens": MAX, "temperature": 1.0, "seed": 11,
            "logprobs": True, "top_logprobs": 3, "ignore_eos": True}
    whole = server.post("/v1/chat/completions", json=body).json()["choices"][0]
    chunks = _raw_stream(server, "/v1/chat/completions", {**body, "stream": True})
    pieces = [c["choices"][0]["logprobs"] for c in chunks[1:]]  # after the role chunk
    assert all(p is not None for p in pieces)
    assert sum(1 for p in pieces if p["content"]) > 1  # spread over the chunks, not all on the last
    streamed = [item for p in pieces for item in p["content"]]
    assert streamed == whole["logprobs"]["content"] and len(streamed) == MAX


def test_completion_logprobs_legacy_shape(server: ServerProc, text_model: tuple[Any, Any]) -> None:
    model, tok = text_model
    prompt = [5, 6, 7, 8, 9]
    done = server.openai().completions.create(model=_name(server), prompt=prompt, max_tokens=MAX, logprobs=3,
                                              extra_body={"ignore_eos": True})
    choice = done.choices[0]
    ids = choice.token_ids
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == MAX
    rows = _log_softmax_rows(model, prompt, ids)
    offset = 0
    for i, (token, row) in enumerate(zip(ids, rows, strict=True)):
        assert lp.tokens[i] == tok.token_text(token)[0]
        assert abs(lp.token_logprobs[i] - row[token]) < TOL
        top = lp.top_logprobs[i]
        assert 1 <= len(top) <= 4 and top[lp.tokens[i]] == lp.token_logprobs[i]  # texts may coincide (U+FFFD)
        assert max(top.values()) == lp.token_logprobs[i]  # greedy: the drawn token is the most likely
        assert lp.text_offset[i] == offset
        offset += len(lp.tokens[i])
    body = {"model": _name(server), "prompt": prompt, "max_tokens": MAX, "logprobs": 3, "ignore_eos": True,
            "stream": True}
    chunks = _raw_stream(server, "/v1/completions", body)
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in merged:
            merged[key] += c["choices"][0]["logprobs"][key]
    assert merged == done.model_dump()["choices"][0]["logprobs"]


def test_session_turn_logprobs_equal_stateless(server: ServerProc) -> None:
    client, name = server.openai(), _name(server)
    stateless = client.chat.completions.create(model=name, messages=MSGS, max_tokens=6, logprobs=True,
                                               top_logprobs=2)
    on_session = client.chat.completions.create(model=name, messages=MSGS, max_tokens=6, logprobs=True,
                                                top_logprobs=2, extra_body={"session": "lp"})
    assert on_session.choices[0].logprobs == stateless.choices[0].logprobs


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": "many"}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 10**30}, "logprobs"),
])
def test_bad_logprobs_are_400(server: ServerProc, path: str, fields: dict[str, Any], param: str) -> None:
    body: dict[str, Any] = {"model": _name(server), "max_tokens": 2, **fields}
    body.update({"messages": MSGS} if "chat" in path else {"prompt": [5, 6]})
    response = server.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
