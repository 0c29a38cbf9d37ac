"""Request options with OpenAI's (and vLLM's) meaning, over a real server and the ``openai`` client:
``ignore_eos`` on chat completions as on completions, and ``stream_options.include_usage`` (one
final chunk with ``choices: []`` and the usage; no usage in a stream otherwise)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.serverkit import ServerProc, sse_events

MAX = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, text_model_dir: Path) -> Any:
    with ServerProc(tmp_path_factory.mktemp("options") / "root", text_model_dir) as proc:
        yield proc


def _name(server: ServerProc) -> str:
    return Path(server.model).name


def _chat(server: ServerProc, seed: int, **extra: Any) -> Any:
    return server.openai().chat.completions.create(
        model=_name(server), messages=[{"role": "user", "content": f"Hello there {seed}"}], max_tokens=MAX,
        temperature=1.0, seed=seed, **extra).choices[0]


def _stopping_seed(server: ServerProc) -> tuple[int, list[int]]:
    """A seed whose stateless reply ends at an eos id before ``MAX`` tokens, and that reply."""
    for seed in range(64):
        choice = _chat(server, seed)
        if choice.finish_reason == "stop" and len(choice.token_ids) < MAX:
            return seed, list(choice.token_ids)
    raise AssertionError("no seed of 64 gave a reply that ends at eos")


@pytest.mark.parametrize("session", [None, "ie"])
def test_ignore_eos_samples_past_eos_on_chat(server: ServerProc, session: str | None) -> None:
    seed, stopped = _stopping_seed(server)
    body = {"ignore_eos": True, **({"session": session} if session else {})}
    choice = _chat(server, seed, extra_body=body)
    assert choice.finish_reason == "length" and len(choice.token_ids) == MAX
    assert choice.token_ids[:len(stopped)] == stopped  # the same draws, on past the eos id
    if session:
        assert len(server.get(f"/v1/sessions/{session}?history=1").json()["history"]) > MAX


def _raw_stream(server: ServerProc, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        return list(sse_events(response))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_usage_only_when_asked_for(server: ServerProc, path: str) -> None:
    body: dict[str, Any] = {"model": _name(server), "max_tokens": 5, "stream": True, "ignore_eos": True}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    for options in (None, {}, {"include_usage": False}):
        chunks = _raw_stream(server, path, body if options is None else {**body, "stream_options": options})
        assert all("usage" not in c for c in chunks), json.dumps(chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    chunks = _raw_stream(server, path, {**body, "stream_options": {"include_usage": True}})
    *content, last = chunks
    assert last["choices"] == [] and last["object"] == content[0]["object"] and last["id"] == content[0]["id"]
    assert last["usage"]["completion_tokens"] == 5 == len(content[-1]["choices"][0]["token_ids"])
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 5
    assert all(c["usage"] is None and c["choices"] for c in content)  # OpenAI's: null on every other chunk


def test_stream_usage_through_the_openai_client(server: ServerProc) -> None:
    stream = server.openai().chat.completions.create(
        model=_name(server), messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]] and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"
