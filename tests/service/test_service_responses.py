"""The Responses API over the real server and the official ``openai`` client: a chain continued
with ``previous_response_id`` (in place, and branched from an older response) gives the text of a
stateless chat completion over the same messages, before and after a server restart; stored
responses are retrieved, listed and deleted; bad references and bodies are OpenAI-shaped 4xx."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kernels.model.text.tokenizer import load_text
from tests.service.serverkit import ServerProc

SAMPLED = {"temperature": 0.9, "top_p": 0.95}
SEED = 7
INSTRUCTIONS = "Be brief."


def _stateless(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, list[int]]:
    """(text, token ids) of a stateless chat completion with the chain's sampling."""
    done = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, seed=SEED,
                                          **SAMPLED)
    assert done.usage.completion_tokens == len(done.choices[0].token_ids)
    return done.choices[0].message.content, list(done.choices[0].token_ids)


def _respond(client: Any, model: str, text: str, prev: str | None, max_tokens: int = 12, **kw: Any) -> Any:
    return client.responses.create(model=model, input=text, instructions=INSTRUCTIONS, previous_response_id=prev,
                                   max_output_tokens=max_tokens, extra_body={"seed": SEED}, **SAMPLED, **kw)


def _messages(*turns: tuple[str, str]) -> list[dict[str, str]]:
    out = [{"role": "system", "content": INSTRUCTIONS}]
    for user, reply in turns:
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return out


def _check(client: Any, model: str, resp: Any, messages: list[dict[str, str]], what: str) -> None:
    text, ids = _stateless(client, model, messages, 12)
    assert resp.output[0].content[0].token_ids == ids, what
    assert resp.output_text == text, what
    assert resp.usage.output_tokens == len(ids), what


def test_chains_and_branches_match_stateless_chat_across_restart(tmp_path: Path, text_model_dir: Path) -> None:
    server = ServerProc(tmp_path / "root", text_model_dir).start()
    try:
        client = server.openai()
        model = client.models.list().data[0].id
        r1 = _respond(client, model, "hello there", None, metadata={"k": "v"})
        assert r1.id.startswith("resp_") and r1.object == "response" and r1.status in ("completed", "incomplete")
        assert r1.output[0].type == "message" and r1.output[0].content[0].type == "output_text"
        assert r1.metadata == {"k": "v"} and r1.store is True and r1.previous_response_id is None
        assert r1.usage.input_tokens_details.cached_tokens == 0
        _check(client, model, r1, [*_messages(), {"role": "user", "content": "hello there"}], "first")

        r2 = _respond(client, model, "and then?", r1.id)  # the newest of its chain: in place
        _check(client, model, r2, [*_messages(("hello there", r1.output_text)),
                                   {"role": "user", "content": "and then?"}], "continued")
        assert r2.usage.input_tokens_details.cached_tokens > 0 and r2.previous_response_id == r1.id
        assert len(server.get("/v1/sessions").json()["data"]) == 1  # one chain, one session

        r3 = _respond(client, model, "something else", r1.id)  # r1 is older now: a branch
        _check(client, model, r3, [*_messages(("hello there", r1.output_text)),
                                   {"role": "user", "content": "something else"}], "branched")
        assert r3.usage.input_tokens_details.cached_tokens > 0
        assert len(server.get("/v1/sessions").json()["data"]) == 2  # the branch is a fork

        assert server.stop() == 0
        server.start()  # the same root: the chains survive
        client = server.openai()
        assert client.responses.retrieve(r2.id).output_text == r2.output_text
        r4 = _respond(client, model, "go on", r2.id)
        _check(client, model, r4, [*_messages(("hello there", r1.output_text), ("and then?", r2.output_text)),
                                   {"role": "user", "content": "go on"}], "after restart")
        assert r4.usage.input_tokens_details.cached_tokens > 0
        r5 = _respond(client, model, "again", r3.id)
        _check(client, model, r5, [*_messages(("hello there", r1.output_text), ("something else", r3.output_text)),
                                   {"role": "user", "content": "again"}], "branch after restart")

        items = client.responses.input_items.list(r4.id)
        assert [(i.role, i.content[0].text) for i in items.data] == [("user", "go on")]
        client.responses.delete(r4.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r4.id)
        with pytest.raises(openai.NotFoundError):
            _respond(client, model, "x", r4.id)
    finally:
        server.stop()


def test_store_false_and_bad_input(tmp_path: Path, text_model_dir: Path) -> None:
    with ServerProc(tmp_path / "root", text_model_dir) as server:
        client = server.openai()
        model = client.models.list().data[0].id
        loose = _respond(client, model, "hello there", None, store=False)
        assert loose.store is False and loose.output_text
        _check(client, model, loose, [*_messages(), {"role": "user", "content": "hello there"}], "store false")
        assert server.get("/v1/sessions").json()["data"] == []  # nothing kept
        assert not list((tmp_path / "root" / "responses").iterdir())
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(loose.id)
        with pytest.raises(openai.NotFoundError) as missing:
            _respond(client, model, "x", loose.id)
        assert missing.value.body["code"] == "response_not_found"
        kept = _respond(client, model, "hello there", None)
        side = _respond(client, model, "an aside", kept.id, store=False)  # continues, keeps nothing
        _check(client, model, side, [*_messages(("hello there", kept.output_text)),
                                     {"role": "user", "content": "an aside"}], "store false continued")
        assert side.usage.input_tokens_details.cached_tokens == 0
        on = _respond(client, model, "and then?", kept.id)  # the chain's session was not touched: in place
        assert on.usage.input_tokens_details.cached_tokens > 0
        assert len(server.get("/v1/sessions").json()["data"]) == 1
        client.responses.delete(kept.id)  # records stand alone: what continued it still continues
        after = _respond(client, model, "more", on.id)
        assert after.usage.input_tokens_details.cached_tokens > 0
        chain = [("hello there", kept.output_text), ("and then?", on.output_text), ("more", after.output_text)]
        sid = server.get("/v1/sessions").json()["data"][0]["id"]
        assert httpx.delete(server.url + f"/v1/sessions/{sid}", timeout=60).status_code == 200
        lost = _respond(client, model, "still there?", after.id)  # the session is gone: rebuilt from messages
        _check(client, model, lost, [*_messages(*chain), {"role": "user", "content": "still there?"}], "rebuilt")
        assert lost.usage.input_tokens_details.cached_tokens == 0
        record = tmp_path / "root" / "responses" / f"{lost.id}.json"
        record.write_text(record.read_text().replace(f'"model": "{model}"', '"model": "another"'))
        with pytest.raises(openai.ConflictError) as other:
            _respond(client, model, "x", lost.id)
        assert other.value.body["code"] == "model_mismatch"
        for bad in ("resp_" + "0" * 48, "../../etc/passwd", "x" * 300):
            r = server.post("/v1/responses", json={"model": model, "input": "hi", "previous_response_id": bad})
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", bad
            assert server.get(f"/v1/responses/{bad}").status_code == 404
        parts = [{"role": "user", "content": [{"type": "input_text", "text": "hello"},
                                              {"type": "input_text", "text": "there"}]}]
        ok = server.post("/v1/responses", json={"model": model, "input": parts, "max_output_tokens": 4})
        assert ok.status_code == 200, ok.text
        items = server.get(f"/v1/responses/{ok.json()['id']}/input_items").json()
        assert items["object"] == "list" and items["data"][0]["content"][0]["text"] == "hello\nthere"
        for body in ({"model": model, "input": []}, {"model": model, "input": 3}, {"model": model},
                     {"model": model, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                     {"model": model, "input": [{"role": "robot", "content": "hi"}]},
                     {"model": model, "input": "hi", "max_output_tokens": 0},
                     {"model": model, "input": "hi", "metadata": {"k": 3}}):
            r = server.post("/v1/responses", json=body)
            assert r.status_code == 400, (body, r.text)
            assert str(tmp_path) not in r.text and "error" in r.json()


def test_streamed_response_events(tmp_path: Path, text_model_dir: Path) -> None:
    with ServerProc(tmp_path / "root", text_model_dir) as server:
        client = server.openai()
        model = client.models.list().data[0].id
        events = list(_respond(client, model, "hello there", None, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added", "response.output_text.delta"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"] or kinds[-1] == "response.incomplete"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == final.output_text == events[-4].text
        _check(client, model, final, [*_messages(), {"role": "user", "content": "hello there"}], "streamed")
        assert client.responses.retrieve(final.id).output_text == deltas
        follow = _respond(client, model, "and then?", final.id)  # a streamed response continues
        assert follow.usage.input_tokens_details.cached_tokens > 0


def test_interleaved_chains_exact_across_evictions(tmp_path: Path, text_model_dir: Path) -> None:
    """Two chains taking turns on a server that keeps one session resident: each turn resumes its
    chain's suspended session in place, token-exact."""
    with ServerProc(tmp_path / "root", text_model_dir, "--max-resident", "1") as server:
        client = server.openai()
        model = client.models.list().data[0].id
        turns: dict[str, list[tuple[str, str]]] = {"a": [], "b": []}
        last: dict[str, str | None] = {"a": None, "b": None}
        for n in range(3):
            for chain in ("a", "b"):
                said = f"{chain} says {n}"
                resp = _respond(client, model, said, last[chain])
                _check(client, model, resp, [*_messages(*turns[chain]), {"role": "user", "content": said}],
                       f"chain {chain} turn {n}")
                if n:
                    assert resp.usage.input_tokens_details.cached_tokens > 0, (chain, n)
                turns[chain].append((said, resp.output_text))
                last[chain] = resp.id
        assert len(server.get("/v1/sessions").json()["data"]) == 2
        evicted = [line for line in server.get("/metrics").text.splitlines()
                   if line.startswith("coli_sessions_evicted_total ")]
        assert evicted and float(evicted[0].split()[1]) >= 4  # every turn but the first two resumed its session


LONG_INPUT = "List the numbers from one to two hundred."
NEVER_SAID = "[sMASK]"  # a special token the shipped model never saw in training: it never samples it


def _endless_glm_mini(directory: Path) -> Path:
    """A copy of the shipped glm-mini whose only eos id is :data:`NEVER_SAID`: its greedy replies run to
    their token limit whatever its weights' words (the responses API has no ``ignore_eos``)."""
    from kernels.model import resolve_model

    shutil.copytree(resolve_model("glm-mini"), directory)
    added = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
    (never_id,) = [t["id"] for t in added if t["content"] == NEVER_SAID]
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((directory / name).read_text())
        (directory / name).write_text(json.dumps({**cfg, "eos_token_id": [never_id]}))
    return directory


def test_a_stream_cut_by_its_client_is_stored_incomplete_and_continues(tmp_path: Path) -> None:
    with ServerProc(tmp_path / "root", _endless_glm_mini(tmp_path / "endless")) as server:  # replies never end
        client = server.openai()
        model = client.models.list().data[0].id
        # an input whose greedy reply runs to max_output_tokens (a short reply, "hello there"'s 8 tokens, can
        # end before the client's cut lands: the faster the step, the likelier)
        stream = client.responses.create(model=model, input=LONG_INPUT, max_output_tokens=2000, stream=True,
                                         temperature=0)
        rid = ""
        for event in stream:
            if event.type == "response.created":
                rid = event.response.id
            if event.type == "response.output_text.delta":
                break
        stream.close()  # the client goes: the turn ends at its next token and is stored as it stands
        deadline = time.monotonic() + 60
        while (got := server.get(f"/v1/responses/{rid}")).status_code == 404 and time.monotonic() < deadline:
            time.sleep(0.05)
        cut = got.json()
        assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "interrupted"}
        assert 0 < cut["usage"]["output_tokens"] < 2000
        cut_ids = cut["output"][0]["content"][0]["token_ids"]
        text = cut["output"][0]["content"][0]["text"]
        follow = client.responses.create(model=model, input="go on", previous_response_id=rid, max_output_tokens=8,
                                         temperature=0)
        assert follow.usage.input_tokens_details.cached_tokens > 0
        # the reference: one stateless run over the ids the session holds, the cut reply's as sampled
        # (a special id it drew, which its text skips, or a merge its text would re-tokenise to) and then
        # the template's ids for the new message, from the <|user|> that closes the reply (one the reply
        # drew last stands for it)
        tok = load_text(tmp_path / "endless")
        user = tok.encode("<|user|>", add_special_tokens=False)
        asked = tok.chat_ids([{"role": "user", "content": LONG_INPUT}], add_generation_prompt=True)
        again = tok.chat_ids([{"role": "user", "content": LONG_INPUT}, {"role": "assistant", "content": text},
                              {"role": "user", "content": "go on"}], add_generation_prompt=True)
        tail = len(again) - again[::-1].index(user[0]) - (0 if cut_ids[-1:] == user else 1)
        held = [*asked, *cut_ids, *again[tail:]]
        assert follow.usage.input_tokens == len(held)
        done = client.completions.create(model=model, prompt=held, max_tokens=8, temperature=0)
        assert follow.output[0].content[0].token_ids == done.choices[0].token_ids


def test_a_bundle_carries_its_chains_to_another_server(tmp_path: Path, text_model_dir: Path) -> None:
    """A chain's session exported from one server and put into another: its stored responses go
    along (responses.json in the bundle), are retrieved there and continue exactly; a deleted
    response does not travel."""
    a = ServerProc(tmp_path / "a", text_model_dir).start()
    b = ServerProc(tmp_path / "b", text_model_dir).start()
    try:
        ca, cb = a.openai(), b.openai()
        model = ca.models.list().data[0].id
        r1 = _respond(ca, model, "hello there", None)
        r2 = _respond(ca, model, "and then?", r1.id)
        gone = _respond(ca, model, "a reply to forget", r2.id)
        ca.responses.delete(gone.id)
        (sid,) = [s["id"] for s in a.get("/v1/sessions").json()["data"]]
        assert a.post(f"/v1/sessions/{sid}/suspend").status_code == 200
        bundle = a.get(f"/v1/sessions/{sid}/bundle")
        assert bundle.status_code == 200 and b"responses.json" in bundle.content[:4096]
        put = httpx.put(b.url + f"/v1/sessions/{sid}/bundle", content=bundle.content, timeout=120)
        assert put.status_code == 200, put.text
        assert cb.responses.retrieve(r2.id).output_text == r2.output_text
        with pytest.raises(openai.NotFoundError):
            cb.responses.retrieve(gone.id)
        r3 = _respond(cb, model, "go on", r2.id)  # continued on the other server
        _check(cb, model, r3, [*_messages(("hello there", r1.output_text), ("and then?", r2.output_text)),
                               {"role": "user", "content": "go on"}], "after the move")
        assert r3.usage.input_tokens_details.cached_tokens > 0  # the moved session, not a new prefill
    finally:
        a.stop()
        b.stop()
