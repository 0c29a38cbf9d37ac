"""Request options with OpenAI's (and vLLM's) meaning, over a real server and the ``openai`` client:
``ignore_eos`` on chat completions as on completions, ``stream_options.include_usage`` (one final
chunk with ``choices: []`` and the usage; no usage in a stream otherwise), and sampling settings
that belong to one request: no seed is a fresh random seed, recorded with a session's turn so the
reply can be drawn again; a later request never inherits an earlier one's settings."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessionstore.sessions import read_manifest
from sessionstore.sessions.conversation_file import read_record
from tests.service.serverkit import ServerProc, sse_events

MAX = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, text_model_dir: Path) -> Any:
    with ServerProc(tmp_path_factory.mktemp("options") / "root", text_model_dir) as proc:
        yield proc


def _name(server: ServerProc) -> str:
    return Path(server.model).name


def _chat(server: ServerProc, seed: int | None, **extra: Any) -> Any:
    """The choice of a stateless chat at temperature 1 (``seed`` None: the request gives none)."""
    given = {} if seed is None else {"seed": seed}
    return server.openai().chat.completions.create(
        model=_name(server), messages=[{"role": "user", "content": f"Hello there {seed or 0}"}], max_tokens=MAX,
        temperature=1.0, **given, **extra).choices[0]


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


def _session_dir(server: ServerProc, sid: str) -> Path:
    return Path(server.root) / "sessions" / sid


def test_no_seed_is_a_fresh_seed_per_request(server: ServerProc) -> None:
    replies = {tuple(_chat(server, None).token_ids) for _ in range(3)}
    assert len(replies) > 1  # at temperature 1, three requests without a seed did not all draw alike
    same = {tuple(_chat(server, 7).token_ids) for _ in range(2)}
    assert len(same) == 1  # a given seed still draws the same reply


def test_a_sessions_turn_records_its_sampler_and_is_reproduced_by_it(server: ServerProc) -> None:
    client, name = server.openai(), _name(server)
    msgs = [{"role": "user", "content": "Tell me about the fox."}]
    reply = client.chat.completions.create(model=name, messages=msgs, max_tokens=MAX, temperature=1.0,
                                           top_p=0.95, extra_body={"session": "rec"})
    record = read_record(_session_dir(server, "rec"))
    assert record is not None and record.sampler is not None and record.turn is None
    drawn = record.sampler
    assert (drawn.temperature, drawn.top_p, drawn.top_k) == (1.0, 0.95, 0) and drawn.seed != 0
    again = client.chat.completions.create(model=name, messages=msgs, max_tokens=MAX, temperature=1.0,
                                           top_p=0.95, seed=drawn.seed)
    assert again.choices[0].token_ids == reply.choices[0].token_ids


def test_a_request_never_inherits_an_earlier_requests_sampling(server: ServerProc) -> None:
    client, name = server.openai(), _name(server)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model=name, messages=msgs, max_tokens=MAX, temperature=1.5, seed=5,
                                           extra_body={"session": "inherit", "top_k": 40})
    msgs = [*msgs, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And of Japan?"}]
    second = client.chat.completions.create(model=name, messages=msgs, max_tokens=MAX,
                                            extra_body={"session": "inherit"})  # no sampling fields: greedy
    greedy = client.chat.completions.create(model=name, messages=msgs, max_tokens=MAX, temperature=0)
    assert second.choices[0].token_ids == greedy.choices[0].token_ids
    record = read_record(_session_dir(server, "inherit"))
    assert record is not None and record.sampler is not None and record.sampler.temperature == 0.0
    # the manifest keeps what the CLI continues with: untouched by API requests
    manifest = read_manifest(_session_dir(server, "inherit") / "manifest.json")
    assert manifest.sampler.temperature == 0.0 and manifest.sampler.seed == 0 and manifest.sampler.top_k == 0
    done = server.post("/v1/completions", json={"model": name, "prompt": [5, 6, 7], "max_tokens": 4,
                                                "temperature": 1.2, "seed": 3, "session": "inherit"})
    assert done.status_code == 200, done.text
    assert read_manifest(_session_dir(server, "inherit") / "manifest.json").sampler == manifest.sampler


def test_cached_tokens_are_the_prompt_tokens_reused_from_the_session(server: ServerProc) -> None:
    client, name = server.openai(), _name(server)
    msgs = [{"role": "user", "content": "Sessions keep their cache."}]
    first = client.chat.completions.create(model=name, messages=msgs, max_tokens=8, extra_body={"session": "cache"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0 == first.session["reused_prefix"]
    msgs = [*msgs, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And then?"}]
    stream = client.chat.completions.create(model=name, messages=msgs, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"session": "cache"})
    chunks = list(stream)
    reused = chunks[-2].session["reused_prefix"]
    assert reused > 0 and chunks[-1].usage.prompt_tokens_details.cached_tokens == reused
    stateless = client.chat.completions.create(model=name, messages=msgs, max_tokens=2)
    assert stateless.usage.prompt_tokens_details.cached_tokens == 0
    # completions: the prompt ids are the whole history; all of it but the pending token is reused
    done = client.completions.create(model=name, prompt=[5, 6, 7, 8], max_tokens=4, extra_body={"session": "ids"})
    assert done.usage.prompt_tokens_details.cached_tokens == 0
    history = server.get("/v1/sessions/ids?history=1").json()["history"]
    more = client.completions.create(model=name, prompt=[*history, 9], max_tokens=4, extra_body={"session": "ids"})
    assert more.usage.prompt_tokens_details.cached_tokens == len(history) - 1 == more.session["reused_prefix"]
    body = {"model": name, "prompt": [*history, 9, 10], "max_tokens": 2, "session": "ids", "stream": True,
            "stream_options": {"include_usage": True}}
    last = _raw_stream(server, "/v1/completions", body)[-1]
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history) + 1  # up to where it differs


# ---- one session key: session, session_id (SGLang's name), X-Session-Id ---------------------------
def _turn_body(server: ServerProc, path: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": _name(server), "max_tokens": 3, **extra}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "Keys name sessions."}]
    elif path == "/v1/completions":
        body["prompt"] = "Keys name sessions."
    else:
        body["input"] = "Keys name sessions."
        body["max_output_tokens"] = body.pop("max_tokens")
    return body


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_session_id_is_the_session_key_on_every_turn_endpoint(server: ServerProc, path: str) -> None:
    sid = "key-" + path.rsplit("/", 1)[-1]
    done = server.post(path, json=_turn_body(server, path, session_id=sid))
    assert done.status_code == 200, done.text
    assert server.get(f"/v1/sessions/{sid}").status_code == 200  # the turn ran on the session it named
    tokens = server.get(f"/v1/sessions/{sid}").json()["tokens"]
    # one meaning: the three keys naming the same session agree
    same = server.post(path, json=_turn_body(server, path, session=sid, session_id=sid), headers={"X-Session-Id": sid})
    assert same.status_code == 200, same.text
    assert server.get(f"/v1/sessions/{sid}").json()["tokens"] >= tokens
    if path != "/v1/responses":
        assert same.json()["session"]["id"] == sid


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_conflicting_session_keys_are_a_400_naming_both(server: ServerProc, path: str) -> None:
    cases = [({"session": "left", "session_id": "right"}, {}, ("session", "session_id")),
             ({"session_id": "left"}, {"X-Session-Id": "right"}, ("session_id", "X-Session-Id")),
             ({"session": "left"}, {"X-Session-Id": "right"}, ("session", "X-Session-Id"))]
    for fields, headers, named in cases:
        done = server.post(path, json=_turn_body(server, path, **fields), headers=headers)
        assert done.status_code == 400, (fields, headers, done.text)
        error = done.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["code"] == "session_mismatch" and error["param"] == named[1]
        assert all(n in error["message"] for n in named) and "'left'" in error["message"], error
    for sid in ("left", "right"):
        assert server.get(f"/v1/sessions/{sid}").status_code == 404  # nothing was created


def test_a_responses_chain_keeps_its_session_key(server: ServerProc) -> None:
    client, name = server.openai(), _name(server)
    first = client.responses.create(model=name, input="A chain on a named session.", max_output_tokens=4,
                                    extra_body={"session_id": "chain-key"})
    before = server.get("/v1/sessions/chain-key").json()["tokens"]
    follow = client.responses.create(model=name, input="Go on.", max_output_tokens=4, previous_response_id=first.id,
                                     extra_headers={"X-Session-Id": "chain-key"})
    assert server.get("/v1/sessions/chain-key").json()["tokens"] > before  # continued in place
    other = server.post("/v1/responses", json={"model": name, "input": "x", "previous_response_id": follow.id,
                                               "session_id": "another"})
    assert other.status_code == 400 and other.json()["error"]["code"] == "session_mismatch", other.text
    assert "'another'" in other.json()["error"]["message"] and "'chain-key'" in other.json()["error"]["message"]
    stateless = server.post("/v1/responses", json={"model": name, "input": "x", "store": False, "session": "s"})
    assert stateless.status_code == 400 and stateless.json()["error"]["param"] == "store", stateless.text


# ---- /v1/completions: OpenAI's four prompt shapes --------------------------------------------------
def test_completions_take_a_list_of_prompts_one_choice_each_in_order(server: ServerProc) -> None:
    client, name = server.openai(), _name(server)
    texts = ["The fox", "A scope is", "Hello there"]
    alone = [client.completions.create(model=name, prompt=t, max_tokens=5, extra_body={"ignore_eos": True})
             for t in texts]
    batch = client.completions.create(model=name, prompt=texts, max_tokens=5, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.token_ids for c in batch.choices] == [a.choices[0].token_ids for a in alone]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 15
    # token-id lists: one prompt, or a list of them
    ids = [[72, 105, 33], [5, 6, 7, 8]]
    one = client.completions.create(model=name, prompt=ids[1], max_tokens=4, extra_body={"ignore_eos": True})
    both = client.completions.create(model=name, prompt=ids, max_tokens=4, extra_body={"ignore_eos": True})
    assert len(both.choices) == 2 and both.choices[1].token_ids == one.choices[0].token_ids


def test_n_multiplies_the_prompts_choice_index_is_prompt_times_n_plus_j(server: ServerProc) -> None:
    name = _name(server)
    texts = ["The fox", "A scope is"]
    body = {"model": name, "max_tokens": 4, "temperature": 1.0, "seed": 11, "n": 3, "ignore_eos": True}
    batch = server.post("/v1/completions", json={**body, "prompt": texts}).json()
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    for p, text in enumerate(texts):  # prompt p's choices are what it gives alone, in order
        alone = server.post("/v1/completions", json={**body, "prompt": text}).json()
        assert [c["token_ids"] for c in batch["choices"][p * 3:p * 3 + 3]] == \
            [c["token_ids"] for c in alone["choices"]]
    streamed = _raw_stream(server, "/v1/completions", {**body, "prompt": texts, "stream": True,
                                                      "stream_options": {"include_usage": True}})
    finals = {c["choices"][0]["index"]: c["choices"][0]["token_ids"] for c in streamed[:-1]
              if c["choices"][0]["finish_reason"]}
    assert finals == {c["index"]: c["token_ids"] for c in batch["choices"]}
    assert streamed[-1]["usage"] == batch["usage"]


@pytest.mark.parametrize("prompt", [5, {"text": "x"}, [1, "a"], [[1, 2], "a"], [[1, -2]], [1.5], [[1], [2.5]],
                                    [True, 2], None])
def test_a_bad_prompt_is_a_400_naming_the_shapes_not_the_validator(server: ServerProc, prompt: Any) -> None:
    done = server.post("/v1/completions", json={"model": _name(server), "prompt": prompt, "max_tokens": 2})
    assert done.status_code == 400, done.text
    error = done.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith(
        "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists"), error
    assert ".str" not in error["message"] and "list[" not in error["message"]


def test_empty_prompts_and_a_session_with_several_prompts_are_400s(server: ServerProc) -> None:
    name = _name(server)
    for prompt, param in (([], "prompt"), ("", "prompt"), (["a", ""], "prompt.1"), ([[1], []], "prompt.1")):
        done = server.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 2})
        assert done.status_code == 400 and done.json()["error"]["param"] == param, (prompt, done.text)
    done = server.post("/v1/completions", json={"model": name, "prompt": ["a", "b"], "session": "two"})
    assert done.status_code == 400 and "one prompt" in done.json()["error"]["message"], done.text
    many = server.post("/v1/completions", json={"model": name, "prompt": ["a"] * 33, "max_tokens": 1})
    assert many.status_code == 400 and many.json()["error"]["code"] == "limit_exceeded", many.text


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages.0.content: must be a string, a list of content parts or null"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": 5},
     "stop: must be a string or a list of strings"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "session_id": 5}, "session_id: "),
    ("/v1/responses", {"input": 5}, "input: must be a string or a list of message items"),
    ("/v1/responses", {"input": [{"role": "user", "content": 7}]},
     "input.0.content: must be a string or a list of content parts"),
])
def test_validation_errors_name_the_body_path_only(server: ServerProc, path: str, body: dict[str, Any],
                                                   message: str) -> None:
    done = server.post(path, json={"model": _name(server), **body})
    assert done.status_code == 400, done.text
    error = done.json()["error"]
    assert error["message"].startswith(message), error
    assert not any(tag in error["message"] for tag in (".str", ".list[", "function-", "constrained", "union")), error
