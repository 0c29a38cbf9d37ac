"""Sampling options of chat and text completions over a real server and the ``openai`` client:
log-probabilities (OpenAI's chat shape and the legacy completions shape, streamed and not), checked
against the in-process model's own log-softmax; the logits processing (penalties, ``logit_bias``,
``min_tokens``) against the in-process turn, across a resume and beside other sessions; ``n``
choices; ``response_format`` JSON that always parses and matches its schema."""
from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.model.logits import TurnDraw, log_softmax
from kernels.model.sampling import Sampler
from sessionstore.sessions.conversation_file import read_record
from sessionstore.sessions.turn_loop import decode_turn, feed_chunk
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


# ---- logits processing: penalties, logit_bias, min_tokens ----------------------------------------
PENALIZED = {"presence_penalty": 1.5, "frequency_penalty": 0.8, "repetition_penalty": 0.7}
# (the test model's greedy replies are sharply peaked and never repeat: penalties that push repeats
# down leave them alone, so the cases below also reward repeats, or sample)


def _reference(model: Any, tok: Any, prompt: list[int], sampler: Sampler, max_new: int) -> list[int]:
    """The in-process turn: the prompt fed to a fresh cache, ``max_new`` tokens drawn (no eos stop)."""
    cache = model.new_cache("fp8")
    logits = feed_chunk(model, cache, prompt)
    draw = TurnDraw(sampler, stop_ids=frozenset(tok.eos_ids))
    return decode_turn(model, cache, None, logits, max_new, draw).tokens


def _chat_ids(server: ServerProc, msgs: list[dict[str, Any]], **fields: Any) -> list[int]:
    body = {"model": _name(server), "messages": msgs, "max_tokens": MAX, "ignore_eos": True, **fields}
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


@pytest.mark.parametrize("fields", [PENALIZED, {"repetition_penalty": 0.5},
                                    {"presence_penalty": -1.5, "frequency_penalty": -0.5, "temperature": 0.9,
                                     "seed": 4},
                                    {**PENALIZED, "repetition_penalty": 1.3, "temperature": 1.0, "seed": 3}])
def test_penalties_equal_the_in_process_turn(server: ServerProc, text_model: tuple[Any, Any],
                                             fields: dict[str, Any]) -> None:
    model, tok = text_model
    got = _chat_ids(server, MSGS, **fields)
    assert got == _reference(model, tok, tok.chat_ids(MSGS), Sampler.checked(**fields), MAX)
    plain = {k: v for k, v in fields.items() if k in ("temperature", "seed")}
    assert got != _chat_ids(server, MSGS, **plain)  # the penalties changed the reply


def test_logit_bias_forces_and_min_tokens_holds_off_eos(server: ServerProc, text_model: tuple[Any, Any]) -> None:
    _, tok = text_model
    forced = 100 if 100 not in tok.eos_ids else 101
    assert set(_chat_ids(server, MSGS, logit_bias={str(forced): 100})) == {forced}
    eos = tok.eos_ids[0]
    client, name = server.openai(), _name(server)
    early = client.chat.completions.create(model=name, messages=MSGS, max_tokens=MAX, logit_bias={str(eos): 100})
    assert early.choices[0].token_ids == [eos] and early.choices[0].finish_reason == "stop"
    held = client.chat.completions.create(model=name, messages=MSGS, max_tokens=MAX, logit_bias={str(eos): 100},
                                          extra_body={"min_tokens": 5})
    ids = held.choices[0].token_ids
    assert len(ids) == 6 and ids[-1] == eos and eos not in ids[:5] and held.choices[0].finish_reason == "stop"


def test_a_session_turn_records_its_processing_and_is_exact_across_resume(server: ServerProc) -> None:
    fields = {**PENALIZED, "temperature": 0.8, "seed": 21, "logit_bias": {"50": 2.5}, "min_tokens": 3}
    first = _chat_ids(server, MSGS, session="pen", **fields)
    record = read_record(Path(server.root) / "sessions" / "pen")
    assert record is not None and record.sampler == Sampler.checked(**fields)
    assert server.post("/v1/sessions/pen/suspend").status_code == 200
    msgs = [*MSGS, {"role": "assistant", "content": server.get("/v1/sessions/pen?messages=1").json()
                    ["messages"][-1]["content"]}, {"role": "user", "content": "And then?"}]
    second = _chat_ids(server, msgs, session="pen", **fields)  # resumed from disk
    assert second == _chat_ids(server, msgs, **fields)  # = the stateless (uninterrupted) run
    recorded = Sampler.from_dict(record.sampler.to_dict()).to_dict()  # regenerate from the record
    assert _chat_ids(server, MSGS, **recorded) == first


def test_concurrent_sessions_equal_their_solo_runs(server: ServerProc) -> None:
    settings = [PENALIZED, {"repetition_penalty": 0.7, "temperature": 1.0, "seed": 3},
                {"frequency_penalty": 1.2, "logit_bias": {"60": 3.0}}, {"min_tokens": 4, "presence_penalty": -0.5}]
    solo = [_chat_ids(server, MSGS, **s) for s in settings]
    with ThreadPoolExecutor(len(settings)) as pool:
        together = list(pool.map(lambda i: _chat_ids(server, MSGS, session=f"conc{i}", **settings[i]),
                                 range(len(settings))))
    assert together == solo


@pytest.mark.parametrize(("fields", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"), ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"), ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"), ({"min_tokens": 10**40}, None),
])
def test_bad_processing_values_are_400(server: ServerProc, fields: dict[str, Any], param: str | None) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        body: dict[str, Any] = {"model": _name(server), "max_tokens": 2, **fields}
        body.update({"messages": MSGS} if "chat" in path else {"prompt": [5, 6]})
        response = server.post(path, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


# ---- n: several choices ---------------------------------------------------------------------------
def test_n_choices_are_samples_with_seed_plus_index(server: ServerProc) -> None:
    client, name = server.openai(), _name(server)
    many = client.chat.completions.create(model=name, messages=MSGS, max_tokens=MAX, temperature=1.0, seed=5, n=3,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2]
    for i, choice in enumerate(many.choices):
        alone = client.chat.completions.create(model=name, messages=MSGS, max_tokens=MAX, temperature=1.0,
                                               seed=5 + i, extra_body={"ignore_eos": True}).choices[0]
        assert choice.token_ids == alone.token_ids and choice.message.content == alone.message.content
    assert len({tuple(c.token_ids) for c in many.choices}) == 3
    assert many.usage.completion_tokens == 3 * MAX
    done = client.completions.create(model=name, prompt=[5, 6, 7], max_tokens=MAX, temperature=1.0, seed=9, n=2,
                                     extra_body={"ignore_eos": True})
    again = client.completions.create(model=name, prompt=[5, 6, 7], max_tokens=MAX, temperature=1.0, seed=10,
                                      extra_body={"ignore_eos": True})
    assert done.choices[1].token_ids == again.choices[0].token_ids and done.choices[1].index == 1


def test_n_on_a_session_commits_choice_zero_only(server: ServerProc) -> None:
    client, name = server.openai(), _name(server)
    many = client.chat.completions.create(model=name, messages=MSGS, max_tokens=MAX, temperature=1.0, seed=8, n=3,
                                          extra_body={"session": "nses", "ignore_eos": True})
    info = server.get("/v1/sessions/nses?history=1&messages=1").json()
    first = many.choices[0]
    assert info["history"][-len(first.token_ids):] == first.token_ids
    assert info["messages"][-1] == {"role": "assistant", "content": first.message.content}
    stateless = client.chat.completions.create(model=name, messages=MSGS, max_tokens=MAX, temperature=1.0, seed=8,
                                               n=3, extra_body={"ignore_eos": True})
    assert [c.token_ids for c in many.choices] == [c.token_ids for c in stateless.choices]


def test_n_streamed_choices_carry_their_index(server: ServerProc) -> None:
    body = {"model": _name(server), "messages": MSGS, "max_tokens": MAX, "temperature": 1.0, "seed": 2, "n": 2,
            "logprobs": True, "ignore_eos": True, "session": "nstream"}
    chunks = _raw_stream(server, "/v1/chat/completions", {**body, "stream": True})
    text = {0: "", 1: ""}
    items: dict[int, list[Any]] = {0: [], 1: []}
    finals = {}
    for c in chunks:
        choice = c["choices"][0]
        text[choice["index"]] += choice["delta"].get("content") or ""
        if choice["logprobs"] is not None:
            items[choice["index"]] += choice["logprobs"]["content"]
        if choice["finish_reason"] is not None:
            finals[choice["index"]] = c
    assert set(finals) == {0, 1} and "session" in finals[0] and "session" not in finals[1]
    server.post("/v1/sessions/nstream/suspend")
    whole = server.post("/v1/chat/completions", json={**body, "session": None}).json()["choices"]
    for i in (0, 1):
        assert text[i] == whole[i]["message"]["content"] and items[i] == whole[i]["logprobs"]["content"]
        assert finals[i]["choices"][0]["token_ids"] == whole[i]["token_ids"]


@pytest.mark.parametrize("n", [0, 9, -1, "many"])
def test_bad_n_is_400(server: ServerProc, n: Any) -> None:
    response = server.post("/v1/chat/completions", json={"model": _name(server), "messages": MSGS, "n": n})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n", response.text


# ---- response_format: grammar-constrained JSON ----------------------------------------------------
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}


def _matches(value: Any) -> bool:
    """``value`` against SCHEMA, rule by rule."""
    return (isinstance(value, dict) and set(value) == {"name", "age", "tags", "ok"}
            and isinstance(value["name"], str) and len(value["name"]) <= 12
            and isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 150
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(t in ("red", "green", "blue") for t in value["tags"]) and isinstance(value["ok"], bool))


needs_grammar = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                   reason="the grammar extra (llguidance) enforces response_format")


@needs_grammar
def test_json_schema_outputs_parse_and_match(server: ServerProc) -> None:
    client, name = server.openai(), _name(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    many = client.chat.completions.create(model=name, messages=MSGS, max_tokens=200, temperature=1.0, seed=1, n=6,
                                          response_format=fmt)
    for choice in many.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert _matches(json.loads(choice.message.content)), choice.message.content
    assert len({c.message.content for c in many.choices}) > 1  # sampled, not one fixed answer
    done = client.completions.create(model=name, prompt="Person:", max_tokens=200, temperature=1.0, seed=2,
                                     extra_body={"response_format": fmt})
    assert _matches(json.loads(done.choices[0].text))
    body = {"model": name, "messages": MSGS, "max_tokens": 200, "temperature": 0.7, "seed": 3,
            "response_format": fmt, "stream": True, "session": "json"}
    chunks = _raw_stream(server, "/v1/chat/completions", body)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert _matches(json.loads(streamed))
    messages = server.get("/v1/sessions/json?messages=1").json()["messages"]
    assert json.loads(messages[-1]["content"]) == json.loads(streamed)
    record = read_record(Path(server.root) / "sessions" / "json")
    assert record is not None and record.sampler is not None and record.response_format == fmt
    again = {"model": name, "messages": MSGS, "max_tokens": 200, **record.sampler.to_dict(),
             "response_format": record.response_format}  # regenerate from the record
    assert server.post("/v1/chat/completions", json=again).json()["choices"][0]["message"]["content"] == streamed


@needs_grammar
def test_json_object_outputs_parse(server: ServerProc) -> None:
    many = server.openai().chat.completions.create(model=_name(server), messages=MSGS, max_tokens=300,
                                                   temperature=0.8, seed=4, n=4,
                                                   response_format={"type": "json_object"})
    for choice in many.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict), choice.message.content
        else:  # cut by max_tokens: still a prefix of an object
            assert choice.message.content.startswith("{")
    assert any(c.finish_reason == "stop" for c in many.choices)


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "if": {}}}}},
     "response_format", "unsupported_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}}},
     "response_format", "unsupported_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "unsupported_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
    ({"response_format": "json"}, "response_format", None),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "invalid_value"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", "invalid_value"),
])
def test_unenforceable_response_formats_are_400(server: ServerProc, fields: dict[str, Any], param: str,
                                                code: str | None) -> None:
    body = {"model": _name(server), "messages": MSGS, "max_tokens": 4, "session": "nojson", **fields}
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and response.json()["error"]["code"] == code
    assert server.get("/v1/sessions/nojson").status_code == 404  # a refused first turn leaves no session


# ---- fuzzed option values: a 200 or OpenAI's 400, never a 500 -------------------------------------
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.integers(-3, 30),
                      st.floats(allow_nan=False, allow_infinity=False), st.floats(-3, 3), st.text(max_size=8))
JSON_VALUE = st.one_of(
    st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                 max_leaves=8),
    st.dictionaries(st.integers(0, 1000).map(str), st.floats(-150, 150), max_size=4),  # near-valid logit_bias
    st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
                     {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}]))
OPTION_NAMES = ["presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "n",
                "logprobs", "top_logprobs", "response_format"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=st.dictionaries(st.sampled_from(OPTION_NAMES), JSON_VALUE, min_size=1, max_size=3),
       chat=st.booleans())
def test_fuzzed_options_are_served_or_refused_in_openais_shape(server: ServerProc, options: dict[str, Any],
                                                               chat: bool) -> None:
    body: dict[str, Any] = {"model": _name(server), "max_tokens": 2, **options}
    body.update({"messages": MSGS} if chat else {"prompt": [5, 6]})
    response = server.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    else:
        assert len(response.json()["choices"]) == body.get("n", 1)


def _batched_steps(server: ServerProc) -> float:
    """Decode steps so far that advanced more than one turn (the batch-size histogram's count above 1)."""
    lines = server.get("/metrics").text.splitlines()
    bucket = {line.split('le="')[1].split('"')[0]: float(line.split()[-1])
              for line in lines if line.startswith("coli_decode_batch_size_bucket")}
    return bucket["+Inf"] - bucket["1.0"]


def test_n_choices_are_stepped_together(server: ServerProc) -> None:
    before = _batched_steps(server)
    many = server.openai().chat.completions.create(model=_name(server), messages=MSGS, max_tokens=MAX, n=4,
                                                   temperature=1.0, seed=6, extra_body={"ignore_eos": True})
    assert len(many.choices) == 4
    assert _batched_steps(server) - before >= MAX // 2  # the choices were queued together, not one after another


# ---- strict schemas refused as OpenAI refuses them ------------------------------------------------
LOOSE_ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _strict_cases() -> list[tuple[dict[str, Any], str]]:
    """Schemas that break a strict rule, and the place in the schema the 400 names."""
    ok_address = {**LOOSE_ADDRESS, "additionalProperties": False}
    return [
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}, ""),
        ({"type": "object", "additionalProperties": False, "properties": {"a": {"type": "string"},
                                                                          "b": {"type": "integer"}},
          "required": ["a"]}, ".required"),
        ({"type": "object", "additionalProperties": False, "required": ["address"],
          "properties": {"address": LOOSE_ADDRESS}}, ".properties.address"),
        ({"type": "object", "additionalProperties": False, "required": ["places"],
          "properties": {"places": {"type": "array", "items": LOOSE_ADDRESS}}}, ".properties.places.items"),
        ({"type": "object", "additionalProperties": False, "required": ["x"],
          "properties": {"x": {"anyOf": [{"type": "string"}, LOOSE_ADDRESS]}}}, ".properties.x.anyOf.1"),
        ({"type": "object", "additionalProperties": False, "required": ["x"], "$defs": {"addr": LOOSE_ADDRESS},
          "properties": {"x": {"$ref": "#/$defs/addr"}}}, ".$defs.addr"),
        ({"type": "object", "additionalProperties": False, "required": ["address"],
          "properties": {"address": {**ok_address, "properties": {"city": {"type": "string"},
                                                                  "zip": {"type": "string"}}}}},
         ".properties.address.required"),
        ({"type": "array", "items": {"type": "string"}}, ""),
    ]


@pytest.mark.parametrize(("schema", "place"), _strict_cases())
def test_strict_schemas_are_refused_as_openai_refuses_them(server: ServerProc, schema: dict[str, Any],
                                                           place: str) -> None:
    name = _name(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    chat = server.post("/v1/chat/completions", json={"model": name, "messages": MSGS, "max_tokens": 4,
                                                     "response_format": fmt})
    assert chat.status_code == 400, chat.text
    error = chat.json()["error"]
    assert error["param"] == "response_format.json_schema.schema" + place and error["code"] == "invalid_schema"
    assert error["message"].startswith(error["param"] + ": a strict schema"), error
    text = {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}
    resp = server.post("/v1/responses", json={"model": name, "input": "hi", "max_output_tokens": 4, "text": text})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "text.format.schema" + place, resp.text


def test_the_same_schemas_without_strict_are_served(server: ServerProc) -> None:
    name = _name(server)
    schema = {"type": "object", "properties": {"address": LOOSE_ADDRESS}, "required": ["address"]}
    for strict in (False, None):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}
        done = server.post("/v1/chat/completions", json={"model": name, "messages": MSGS, "max_tokens": 4,
                                                         "response_format": fmt})
        assert done.status_code == 200, done.text


# ---- the Responses API's text.format: the same grammar as chat's response_format --------------------
@needs_grammar
def test_responses_text_format_json_schema_is_enforced_and_echoed(server: ServerProc) -> None:
    client, name = server.openai(), _name(server)
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    resp = client.responses.create(model=name, input=MSGS[0]["content"], max_output_tokens=200, temperature=1.0,
                                   text={"format": fmt}, extra_body={"seed": 5})
    assert resp.status == "completed" and _matches(json.loads(resp.output_text)), resp.output_text
    echoed = resp.text.format
    assert (echoed.type, echoed.name, echoed.strict, echoed.schema_) == ("json_schema", "person", True, SCHEMA)
    stored = server.get(f"/v1/responses/{resp.id}").json()["text"]["format"]
    assert stored == {**fmt, "description": None}  # the echo survives in the stored record
    chat = client.chat.completions.create(model=name, messages=MSGS, max_tokens=200, temperature=1.0, seed=5,
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "person", "schema": SCHEMA, "strict": True}})
    assert chat.choices[0].token_ids == resp.output[0].content[0].token_ids  # the same draw under the same grammar
    # continued on the chain under another format, and streamed
    body = {"model": name, "input": "Another one.", "previous_response_id": resp.id, "max_output_tokens": 200,
            "stream": True, "text": {"format": {"type": "json_object"}}}
    events = _raw_stream(server, "/v1/responses", body)
    done = events[-1]["response"]
    assert done["text"]["format"] == {"type": "json_object"}
    streamed = done["output"][0]["content"][0]["text"]
    if events[-1]["type"] == "response.completed":  # ended by the grammar: a whole object
        assert isinstance(json.loads(streamed), dict), streamed
    else:  # cut by max_output_tokens: still a prefix of an object
        assert events[-1]["type"] == "response.incomplete" and streamed.startswith("{"), streamed


@needs_grammar
def test_responses_text_format_json_object_and_text(server: ServerProc) -> None:
    client, name = server.openai(), _name(server)
    obj = client.responses.create(model=name, input="Give me JSON.", max_output_tokens=300, store=False,
                                  text={"format": {"type": "json_object"}})
    assert obj.text.format.type == "json_object" and isinstance(json.loads(obj.output_text), dict)
    plain = client.responses.create(model=name, input="Hello.", max_output_tokens=4, text={"format": {"type": "text"}})
    assert plain.text.format.type == "text"


@pytest.mark.parametrize(("text", "param"), [
    ({"format": {"type": "yaml"}}, "text.format.type"),
    ({"format": {"type": "json_schema", "schema": SCHEMA}}, "text.format.name"),
    ({"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
    ({"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": "yes"}}, "text.format.strict"),
    ("json", "text"),
    ({"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "if": {}}}}, "text.format"),
])
def test_bad_text_formats_are_400(server: ServerProc, text: Any, param: str) -> None:
    done = server.post("/v1/responses", json={"model": _name(server), "input": "hi", "text": text,
                                              "max_output_tokens": 4})
    assert done.status_code == 400 and done.json()["error"]["param"] == param, done.text
