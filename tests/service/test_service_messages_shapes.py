"""Chat messages as OpenAI clients send them, over a real server and the ``openai`` client: content
as a list of text parts (other part types: 400), ``developer`` rendered as ``system``, ``tool``
messages and assistant ``tool_calls`` through a chat template that renders them (else a clear
400); and no error message names a server path."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from kernels.model.text import load_text
from sessionstore.service.errors import scrub_paths, server_places
from sessionstore.sessions import SessionStore
from tests.kernels.model.text.textkit import write_text_model
from tests.service.serverkit import ServerProc

TOOLS_TEMPLATE = (  # ChatML with tool calls written out (as tool-calling templates do)
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"fox\"}"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, text_model_dir: Path) -> Any:
    root = tmp_path_factory.mktemp("shapes") / "root"
    SessionStore(root).create("other", "tiny").close()  # a session of another model
    with ServerProc(root, text_model_dir) as proc:
        yield proc


@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = write_text_model(tmp_path_factory.mktemp("tools-model"), "chatml")
    config = model_dir / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": TOOLS_TEMPLATE}))
    return model_dir


def _chat(server: ServerProc, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": Path(server.model).name, "messages": messages, "max_tokens": 6, "temperature": 0, **extra}
    return server.post("/v1/chat/completions", json=body)


def _error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    err: dict[str, Any] = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _ids(server: ServerProc, messages: list[dict[str, Any]]) -> list[int]:
    reply = server.openai().chat.completions.create(model=Path(server.model).name, messages=messages,
                                                    max_tokens=6, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    ids: list[int] = reply.choices[0].token_ids
    return ids


def test_text_parts_are_the_joined_string(server: ServerProc) -> None:
    parts = [{"type": "text", "text": "Hello there,"}, {"type": "text", "text": "how are you?"}]
    as_parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": parts}]
    as_string = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there,\nhow are you?"}]
    assert _ids(server, as_parts) == _ids(server, as_string)
    first = _chat(server, as_parts).json()
    assert first["usage"]["prompt_tokens"] == _chat(server, as_string).json()["usage"]["prompt_tokens"]


def test_a_part_that_is_not_text_is_a_clear_400(server: ServerProc) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    err = _error(_chat(server, [{"role": "user", "content": [{"type": "text", "text": "look"}, image]}]))
    assert err["param"] == "messages.0.content.1.type" and err["code"] == "unsupported_content"
    assert "'image_url'" in err["message"] and "text" in err["message"]
    assert _error(_chat(server, [{"role": "user", "content": [{"type": "text"}]}]))["param"] == \
        "messages.0.content.0.text"
    assert _error(_chat(server, [{"role": "user", "content": ["bare"]}]))["code"] == "unsupported_content"
    assert _error(_chat(server, [{"role": "user", "content": None}]))["param"] == "messages.0.content"


def test_developer_is_system(server: ServerProc) -> None:
    user = {"role": "user", "content": "What is the capital of France?"}
    assert _ids(server, [{"role": "developer", "content": "Be brief."}, user]) == \
        _ids(server, [{"role": "system", "content": "Be brief."}, user])


def test_tool_messages_without_template_support_are_a_clear_400(server: ServerProc) -> None:
    tool = [{"role": "user", "content": "find the fox"}, {"role": "tool", "content": "a fox", "tool_call_id": "c"}]
    err = _error(_chat(server, tool))
    assert err["code"] == "unsupported_messages" and "unknown role: tool" in err["message"]
    calls: list[dict[str, Any]] = [{"role": "user", "content": "find the fox"},
                                   {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    err = _error(_chat(server, calls))
    assert err["code"] == "unsupported_messages" and err["param"] == "messages.1.tool_calls"
    assert "tool calls" in err["message"]
    err = _error(_chat(server, [{"role": "user", "content": "x", "tool_calls": [CALL]}]))
    assert err["param"] == "messages.0.tool_calls"


def test_tool_calls_and_tool_messages_render_through_a_template_that_has_them(tools_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    tok = load_text(tools_model_dir)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "find the fox"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "The quick brown fox", "tool_call_id": "call_1"}]
    rendered: list[dict[str, Any]] = [messages[0], {**messages[1], "content": ""}, messages[2]]
    assert '"name": "lookup"' in tok.render(rendered)  # the call itself reaches the prompt
    with ServerProc(tmp_path / "root", tools_model_dir) as server:
        reply = _chat(server, messages, session="agent")
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == len(tok.chat_ids(rendered))
        stored = server.get("/v1/sessions/agent?messages=1").json()["messages"]
        assert stored[:3] == rendered and stored[3]["role"] == "assistant"


def test_no_error_names_a_server_path(server: ServerProc, text_model_dir: Path) -> None:
    root = str(Path(server.root).resolve())
    bad = [_chat(server, [{"role": "developer", "content": "x"}, {"role": "tool", "content": "y"}]),
           _chat(server, [{"role": "wizard", "content": "x"}]),
           _chat(server, [{"role": "user", "content": "x"}], session="other"),
           _chat(server, [{"role": "user", "content": "x"}], model=str(text_model_dir)),
           server.post("/v1/completions", json={"model": Path(server.model).name, "prompt": [10**6]}),
           server.get("/v1/sessions/nope/bundle")]
    for response in bad:
        assert 400 <= response.status_code < 500, response.text
        for place in (str(text_model_dir), str(text_model_dir.resolve()), root, "/tmp/"):
            assert place not in response.text, response.text


def test_scrub_paths_names_the_servers_places_and_hides_others(tmp_path: Path) -> None:
    model = tmp_path / "models" / "glm"
    places = server_places({"<model dir>": str(model), "<store root>": str(tmp_path / "root"), "<none>": None,
                            "<bare>": "tiny"})
    said = f"{model}/tokenizer.json: bad; {tmp_path}/root/sessions/a; /etc/passwd; GET /v1/sessions/x; tiny"
    assert scrub_paths(said, places) == ("<model dir>/tokenizer.json: bad; <store root>/sessions/a; <path>; "
                                         "GET /v1/sessions/x; tiny")
    assert scrub_paths("http://127.0.0.1:8000/v1/models and /healthz") == "http://127.0.0.1:8000/v1/models and /healthz"
