"""OpenAI's Conversations API over the real server and the official ``openai`` client (FORMAT.md
7.5): a conversation is a session; created with items, listed a page at a time in either order; a
Responses turn with ``conversation`` appends its input and output items and runs on the session,
resuming its KV token-exact after a server restart (the same tokens as a stateless chat completion
over the same messages); deleting an item the KV consumed truncates the session; unknown ids are
404s and bad bodies 400s in OpenAI's error shape. One server for the module (restarted once)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.service.serverkit import ServerProc

SAMPLED = {"temperature": 0.9, "top_p": 0.95}
SEED = 7
INSTRUCTIONS = "Be brief."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, text_model_dir: Path) -> Iterator[ServerProc]:
    with ServerProc(tmp_path_factory.mktemp("conversations") / "root", text_model_dir) as proc:
        yield proc


def _model(client: Any) -> str:
    return str(client.models.list().data[0].id)


def _stateless_ids(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> list[int]:
    done = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, seed=SEED,
                                          **SAMPLED)
    return list(done.choices[0].token_ids)


def _respond(client: Any, model: str, text: str, conversation: Any, max_tokens: int = 10, **kw: Any) -> Any:
    return client.responses.create(model=model, input=text, instructions=INSTRUCTIONS, conversation=conversation,
                                   max_output_tokens=max_tokens, extra_body={"seed": SEED}, **SAMPLED, **kw)


def _texts(items: Any) -> list[tuple[str, str]]:
    return [(i.role, i.content[0].text) for i in items]


def _session(server: ServerProc, sid: str) -> dict[str, Any]:
    r = server.get(f"/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_create_list_pages_update_and_delete(server: ServerProc) -> None:
    client = server.openai()
    given = [{"type": "message", "role": "user", "content": f"item {i}"} for i in range(5)]
    conv = client.conversations.create(items=given, metadata={"topic": "pages"})
    assert conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "pages"}
    assert client.conversations.retrieve(conv.id).created_at == conv.created_at
    assert _session(server, conv.id)["tokens"] == 0  # a session; its KV takes the items at the first turn

    newest_first = client.conversations.items.list(conv.id)
    assert _texts(newest_first.data) == [("user", f"item {i}") for i in (4, 3, 2, 1, 0)]
    assert newest_first.data[0].content[0].type == "input_text" and newest_first.data[0].status == "completed"
    page = client.conversations.items.list(conv.id, order="asc", limit=2)
    assert _texts(page.data) == [("user", "item 0"), ("user", "item 1")] and page.has_more
    assert page.first_id == page.data[0].id and page.last_id == page.data[1].id
    every = [item.content[0].text for item in client.conversations.items.list(conv.id, order="asc", limit=2)]
    assert every == [f"item {i}" for i in range(5)]  # the SDK follows after= / has_more
    raw = server.get(f"/v1/conversations/{conv.id}/items", params={"limit": 2, "after": page.last_id,
                                                                   "include": "message.output_text.logprobs"})
    assert [i["content"][0]["text"] for i in raw.json()["data"]] == ["item 0"]  # newest first, after item 1

    added = client.conversations.items.create(conv.id, items=[{"type": "message", "role": "assistant",
                                                                "content": "an answer"}])
    assert added.object == "list" and added.data[0].content[0].type == "output_text"
    one = client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert one.id == added.data[0].id and one.role == "assistant"
    after = client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert after.id == conv.id and after.object == "conversation"
    assert len(client.conversations.items.list(conv.id).data) == 5

    assert client.conversations.update(conv.id, metadata={"topic": "new"}).metadata == {"topic": "new"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "new"}
    assert conv.id in [s["id"] for s in server.get("/v1/sessions").json()["data"]]
    gone = client.conversations.delete(conv.id)
    assert (gone.id, gone.object, gone.deleted) == (conv.id, "conversation.deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    assert server.get(f"/v1/sessions/{conv.id}").status_code == 404


def test_turns_append_items_and_resume_token_exact_across_restart(server: ServerProc) -> None:
    client = server.openai()
    model = _model(client)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "hello there"},
                                              {"type": "message", "role": "assistant", "content": "hi"}])
    history = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "hello there"},
               {"role": "assistant", "content": "hi"}]
    r1 = _respond(client, model, "tell me more", conv.id)
    history.append({"role": "user", "content": "tell me more"})
    assert r1.output[0].content[0].token_ids == _stateless_ids(client, model, history, 10)
    assert r1.conversation is not None and r1.conversation.id == conv.id
    history.append({"role": "assistant", "content": r1.output_text})
    items = client.conversations.items.list(conv.id, order="asc").data
    assert _texts(items)[2:] == [("user", "tell me more"), ("assistant", r1.output_text)]
    assert items[3].id == r1.output[0].id
    tokens = _session(server, conv.id)["tokens"]
    assert tokens == r1.usage.input_tokens + r1.usage.output_tokens

    assert server.stop() == 0
    server.start()  # the same root: the conversation, its items and its KV survive
    client = server.openai()
    assert _texts(client.conversations.items.list(conv.id, order="asc").data)[3] == ("assistant", r1.output_text)
    assert _session(server, conv.id)["state"] == "suspended"
    r2 = _respond(client, model, "and then?", {"id": conv.id})
    history.append({"role": "user", "content": "and then?"})
    assert r2.output[0].content[0].token_ids == _stateless_ids(client, model, history, 10)
    assert r2.usage.input_tokens_details.cached_tokens > 0  # resumed from the stored KV, not re-prefilled
    assert client.responses.retrieve(r2.id).conversation.id == conv.id
    history.append({"role": "assistant", "content": r2.output_text})

    # a response of the conversation continued with previous_response_id branches; the conversation stays
    side = client.responses.create(model=model, input="aside", previous_response_id=r1.id, max_output_tokens=4)
    assert side.conversation is None
    assert len(client.conversations.items.list(conv.id).data) == 6

    # deleting a consumed item cuts the session where that item's tokens begin
    items = client.conversations.items.list(conv.id, order="asc").data
    before = _session(server, conv.id)["tokens"]
    client.conversations.items.delete(items[4].id, conversation_id=conv.id)  # "and then?"
    cut = _session(server, conv.id)["tokens"]
    assert cut < r1.usage.input_tokens + r1.usage.output_tokens + 4 and cut < before
    history = [m for m in history if m["content"] != "and then?"][:-1]  # its reply stays an item
    history.append({"role": "assistant", "content": r2.output_text})
    r3 = _respond(client, model, "last one", conv.id)
    history.append({"role": "user", "content": "last one"})
    assert r3.output[0].content[0].token_ids == _stateless_ids(client, model, history, 10)
    assert 0 < r3.usage.input_tokens_details.cached_tokens <= cut
    listed = _session(server, conv.id)
    assert listed["tokens"] == r3.usage.input_tokens + r3.usage.output_tokens

    # a streamed turn on the conversation appends as a whole one does
    events = list(client.responses.create(model=model, input="streamed", conversation=conv.id, max_output_tokens=4,
                                          stream=True))
    done = events[-1].response
    assert done.conversation.id == conv.id
    assert _texts(client.conversations.items.list(conv.id, limit=2).data) == [("assistant", done.output_text),
                                                                             ("user", "streamed")]


def test_unknown_ids_and_bad_bodies(server: ServerProc) -> None:
    client = server.openai()
    model = _model(client)
    unknown = "conv_" + "0" * 48
    with pytest.raises(openai.NotFoundError) as missing:
        client.conversations.retrieve(unknown)
    assert missing.value.body["code"] == "conversation_not_found"
    for path in (f"/v1/conversations/{unknown}", f"/v1/conversations/{unknown}/items",
                 f"/v1/conversations/{unknown}/items/msg_1", "/v1/conversations/..%2F..%2Fetc"):
        r = server.get(path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", (path, r.text)
    with pytest.raises(openai.NotFoundError):
        _respond(client, model, "hi", unknown)
    plain = server.post("/v1/chat/completions", json={"model": model, "session": "plain", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert plain.status_code == 200  # a session that is no conversation is not one
    assert server.get("/v1/conversations/plain").status_code == 404
    assert httpx.delete(server.url + "/v1/conversations/plain", timeout=60).status_code == 404
    assert server.get("/v1/sessions/plain").status_code == 200

    conv = client.conversations.create()
    r1 = _respond(client, model, "hi", conv.id, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        _respond(client, model, "hi", conv.id, previous_response_id=r1.id)
    assert server.get(f"/v1/conversations/{conv.id}/items/msg_none").status_code == 404
    assert httpx.delete(server.url + f"/v1/conversations/{conv.id}/items/msg_none", timeout=60).status_code == 404
    root = str(server.root)
    bad = [("/v1/conversations", {"items": 3}), ("/v1/conversations", {"metadata": {"k": 3}}),
           ("/v1/conversations", {"items": [{"role": "robot", "content": "x"}]}),
           ("/v1/conversations", {"items": [{"role": "user", "content": [{"type": "input_image"}]}]}),
           ("/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}),
           ("/v1/conversations", {"metadata": {str(i): "v" for i in range(17)}}),
           (f"/v1/conversations/{conv.id}", {}), (f"/v1/conversations/{conv.id}/items", {}),
           (f"/v1/conversations/{conv.id}/items", {"items": "x"}),
           ("/v1/responses", {"model": model, "input": "hi", "conversation": {}}),
           ("/v1/responses", {"model": model, "input": "hi", "conversation": 3})]
    for path, body in bad:
        r = server.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        assert root not in r.text and "Traceback" not in r.text and r.json()["error"]["type"]
    assert server.post("/v1/conversations", content=b"{nope").status_code == 400
    for query in ({"limit": "0"}, {"limit": "x"}, {"order": "up"}):
        assert server.get(f"/v1/conversations/{conv.id}/items", params=query).status_code == 400, query
    assert server.get(f"/v1/conversations/{conv.id}/items", params={"after": "msg_none"}).status_code == 404
    assert len(client.conversations.items.list(conv.id).data) == 2  # nothing above changed it


def test_a_bundle_carries_the_conversation_and_a_fork_is_a_plain_session(server: ServerProc) -> None:
    client = server.openai()
    model = _model(client)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "hello there"}],
                                       metadata={"k": "v"})
    first = _respond(client, model, "go on", conv.id, max_tokens=6)
    bundle = server.get(f"/v1/sessions/{conv.id}/bundle")
    assert bundle.status_code == 200
    put = httpx.put(server.url + "/v1/sessions/conv-copy/bundle", content=bundle.content, timeout=120)
    assert put.status_code == 200, put.text
    copy = client.conversations.retrieve("conv-copy")  # the installed id names the conversation
    assert copy.metadata == {"k": "v"}
    assert _texts(client.conversations.items.list("conv-copy", order="asc").data) == _texts(
        client.conversations.items.list(conv.id, order="asc").data)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    again = _respond(client, model, "more", "conv-copy", max_tokens=4)
    assert again.usage.input_tokens_details.cached_tokens > 0  # the KV came with it
    assert len(client.conversations.items.list(conv.id).data) == 3  # the original is untouched

    fork = server.post(f"/v1/sessions/{conv.id}/fork", json={"new": "conv-fork"})
    assert fork.status_code == 200, fork.text
    assert server.get("/v1/sessions/conv-fork", params={"messages": 1}).json()["messages"][-1]["content"] == \
        first.output_text
    assert server.get("/v1/conversations/conv-fork").status_code == 404
