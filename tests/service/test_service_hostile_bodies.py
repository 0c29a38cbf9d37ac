"""Hostile request bodies over a real server: each is a 4xx in OpenAI's error shape (never a 500,
never a traceback) and the server stays up; the bearer scheme is matched in any case. The JSON
reader's limits in process."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessionstore.service.errors import ApiError
from sessionstore.service.http.jsonbody import MAX_JSON_DEPTH, json_depth, read_json_body
from tests.service.serverkit import ServerProc

KEY = "sekrit"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, text_model_dir: Path) -> Any:
    with ServerProc(tmp_path_factory.mktemp("hostile") / "root", text_model_dir, "--api-key", KEY) as proc:
        yield proc


def _chat_body(server: ServerProc, **fields: Any) -> dict[str, Any]:
    return {"model": Path(server.model).name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **fields}


def _hostile(server: ServerProc) -> dict[str, tuple[str, bytes]]:
    """name -> (path, raw body)."""
    chat = json.dumps(_chat_body(server))
    completion = {"model": Path(server.model).name, "max_tokens": 2}

    def with_chat(field: str, raw: str) -> bytes:
        return (chat[:-1] + f', "{field}": {raw}}}').encode()

    def with_response(field: str, raw: str) -> bytes:
        body = {"model": Path(server.model).name, "input": "hi", "max_output_tokens": 2}
        body.pop(field, None)
        return (json.dumps(body)[:-1] + f', "{field}": {raw}}}').encode()

    return {
        "deep array": ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000),
        "deep in a field": ("/v1/chat/completions", with_chat("metadata", "[" * 5000 + "]" * 5000)),
        "deep object": ("/v1/chat/completions", with_chat("x", '{"a": ' * 2000 + "1" + "}" * 2000)),
        "5000-digit seed": ("/v1/chat/completions", with_chat("seed", "9" * 5000)),
        "5000-digit max_tokens": ("/v1/chat/completions", with_chat("max_tokens", "-" + "9" * 5000)),
        "huge token id": ("/v1/completions", json.dumps({**completion, "prompt": [10**30]}).encode()),
        "negative token id": ("/v1/completions", json.dumps({**completion, "prompt": [-1]}).encode()),
        "seed past u64": ("/v1/chat/completions", with_chat("seed", str(1 << 70))),
        "top_k past i64": ("/v1/chat/completions", with_chat("top_k", str(1 << 70))),
        "NaN temperature": ("/v1/chat/completions", with_chat("temperature", "NaN")),
        "infinite top_p": ("/v1/chat/completions", with_chat("top_p", "1e400")),
        "max_tokens float": ("/v1/chat/completions", with_chat("max_tokens", "1e300")),
        "invalid UTF-8": ("/v1/chat/completions", chat.replace('"hi"', '"h\xffi"').encode("latin-1")),
        "UTF-16": ("/v1/chat/completions", chat.encode("utf-16")),
        "lone surrogate": ("/v1/chat/completions", chat.replace('"hi"', '"a\\ud800b"').encode()),
        "lone low surrogate in a key": ("/v1/chat/completions", with_chat('"\\udc00"', "1")),
        "lone surrogate in stop": ("/v1/chat/completions", with_chat("stop", '"\\ud83d"')),
        "lone surrogate prompt": ("/v1/completions", json.dumps({**completion, "prompt": "\ud800"}).encode()),
        "null messages": ("/v1/chat/completions", with_chat("messages", "null")),
        "message not an object": ("/v1/chat/completions", with_chat("messages", "[1]")),
        "empty body": ("/v1/chat/completions", b""),
        "fork: deep": ("/v1/sessions/x/fork", b"{" * 10_000),
        "responses: deep input": ("/v1/responses", with_response("input", "[" * 5000 + "]" * 5000)),
        "responses: 5000-digit seed": ("/v1/responses", with_response("seed", "9" * 5000)),
        "responses: seed past u64": ("/v1/responses", with_response("seed", str(1 << 70))),
        "responses: lone surrogate": ("/v1/responses", with_response("input", '"a\\ud800b"')),
        "responses: null input": ("/v1/responses", with_response("input", "null")),
        "responses: item not an object": ("/v1/responses", with_response("input", "[1]")),
        "responses: previous id a list": ("/v1/responses", with_response("previous_response_id", '["x"]')),
        "responses: previous id unknown": ("/v1/responses", with_response("previous_response_id", '"resp_1"')),
        "responses: metadata nested": ("/v1/responses", with_response("metadata", '{"a": {"b": 1}}')),
        "responses: tools": ("/v1/responses", with_response("tools", '[{"type": "function"}]')),
        "responses: NaN temperature": ("/v1/responses", with_response("temperature", "NaN")),
    }


def test_every_hostile_body_is_a_4xx_and_the_server_stays_up(server: ServerProc) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    wrong = []
    for name, (path, raw) in _hostile(server).items():
        response = httpx.post(server.url + path, content=raw, headers=headers, timeout=60)
        err = response.json().get("error") or {}
        if not (400 <= response.status_code < 500 and set(err) == {"message", "type", "param", "code"}
                and err["message"] and "internal error" not in err["message"]):
            wrong.append((name, response.status_code, response.text[:300]))
    assert not wrong, wrong
    assert server.get("/healthz").json()["status"] == "ok"
    assert "Traceback" not in server.stderr()
    ok = httpx.post(server.url + "/v1/chat/completions", json=_chat_body(server), headers=headers, timeout=60)
    assert ok.status_code == 200, ok.text


def test_the_bearer_scheme_is_matched_in_any_case(server: ServerProc) -> None:
    for value in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}", f"bEaReR {KEY}"):
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": value}).status_code == 200, value
    for value in (f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer", f"Bearer{KEY}", ""):
        response = httpx.get(server.url + "/v1/models", headers={"Authorization": value})
        assert response.status_code == 401, value
    import openai

    assert openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).models.list().data


def test_the_json_reader_limits() -> None:
    assert json_depth(b'{"a": [{"b": "]]]]"}, [[]]]}') == 4
    assert json_depth(b'"[[[[\\"[["') == 0
    nested = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert read_json_body(nested) == json.loads(nested)  # the limit itself is allowed
    with pytest.raises(ApiError, match="nests 65 deep"):
        read_json_body(b"[" + nested + b"]")
    assert read_json_body(b'{"s": "\\ud83d\\ude00", "n": ' + b"9" * 40 + b"}") == {"s": "\U0001f600", "n": 10**40 - 1}
    with pytest.raises(ApiError) as refused:
        read_json_body(b'{"m": [{"c": ["ok", "\\udfff"]}]}')
    assert refused.value.param == "m.0.c.1" and refused.value.status == 400
