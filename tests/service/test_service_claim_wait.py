"""A request that follows a turn which has ended is served, not refused (FORMAT.md 7, the busy rule), over
a real server whose post-reply commits and conversation writes are slowed
(:mod:`tests.support.slow_commit_serve`), so every next request arrives while the turn before it still
holds its session: a streamed chat turn cut (or read to ``[DONE]``) and the next one sent at once; a
conversation's items polled until the turn's items appear, then edited and continued at once, and a
conversation turn cut and continued at once. A session held by a turn still generating keeps its
immediate 409."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessionstore.service.engine.claims import CLAIM_WAIT_S
from tests.service.serverkit import ServerProc

TURNS = 6  # streamed turns, each sent at once after the one before it (the slowed commits force the race each time)
CUT_AFTER = 3  # SSE events read before a turn's stream is cut
SLOW_S = "0.15"  # each slowed fsync (seconds): the window the next request always lands in
POLL_S = 0.01  # between polls of a conversation's items


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, text_model_dir: Path) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("claim-wait") / "root"
    with ServerProc(root, text_model_dir, module="tests.support.slow_commit_serve",
                    env={"COLI_TEST_SLOW_FSYNC_S": SLOW_S}) as proc:
        proc.model_id = proc.get("/v1/models").json()["data"][0]["id"]
        yield proc


def _stream(url: str, path: str, body: dict[str, Any], headers: dict[str, str], cut: bool) -> tuple[int, list[Any]]:
    """POST a streamed request: its status and the SSE data it read (cut after :data:`CUT_AFTER` events)."""
    got: list[Any] = []
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=120) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, [response.text]
        for line in response.iter_lines():
            if line.startswith("data: "):
                got.append(line[6:])
                if cut and len(got) >= CUT_AFTER:
                    break  # the stream is closed here: the turn ends at its next token and commits
    return 200, got


def test_the_next_turn_sent_at_once_after_a_cut_or_finished_stream_is_served(server: ServerProc) -> None:
    messages = [{"role": "user", "content": "hello"}]
    headers = {"X-Session-Id": "next-at-once"}
    for i in range(TURNS):
        cut = i % 3 != 2  # two of three cut mid-reply, the third read to [DONE]
        body = {"model": server.model_id, "messages": messages, "max_tokens": 400 if cut else 6,
                "ignore_eos": cut, "stream": True, "temperature": 0}
        status, data = _stream(server.url, "/v1/chat/completions", body, headers, cut)
        assert status == 200, (i, data)
        assert not any('"error"' in d for d in data), (i, data)
        if not cut:
            assert data[-1] == "[DONE]"
        messages = [*messages, {"role": "user", "content": f"and {i}"}]
    info = server.get("/v1/sessions/next-at-once").json()
    assert info["tokens"] > TURNS * 3  # every turn ran on the session


def test_a_session_held_by_a_generating_turn_is_refused_at_once(server: ServerProc) -> None:
    body = {"model": server.model_id, "prompt": [5, 6, 7], "max_tokens": 4000, "stream": True, "ignore_eos": True,
            "session": "generating"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the turn is generating
        t0 = time.monotonic()
        second = server.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        waited = time.monotonic() - t0
        assert second.status_code == 409, second.text
        assert second.json()["error"]["code"] == "session_busy"
        assert waited < CLAIM_WAIT_S / 2, waited  # refused at once, not after the wait for an ending turn
        assert server.post("/v1/sessions/generating/suspend").status_code == 409


def _items(server: ServerProc, conv: str) -> list[dict[str, Any]]:
    r = server.get(f"/v1/conversations/{conv}/items", params={"order": "asc", "limit": 100})
    assert r.status_code == 200, r.text
    data: list[dict[str, Any]] = r.json()["data"]
    return data


def _respond_body(server: ServerProc, conv: str, text: str, **kw: Any) -> dict[str, Any]:
    return {"model": server.model_id, "input": text, "conversation": conv, "max_output_tokens": 6,
            "temperature": 0, **kw}


def test_conversation_items_polled_then_edited_and_continued_at_once(server: ServerProc) -> None:
    conv = server.post("/v1/conversations", json={}).json()["id"]
    for i in range(2):
        before = len(_items(server, conv))
        outcome: dict[str, httpx.Response] = {}
        body = _respond_body(server, conv, f"question {i}")
        turn = threading.Thread(target=lambda out=outcome, b=body: out.update(r=server.post("/v1/responses", json=b)))
        turn.start()
        while len(_items(server, conv)) < before + 2:  # its input and output items, visible once written
            assert turn.is_alive(), outcome
            time.sleep(POLL_S)
        assert turn.is_alive()  # not answered yet: the turn still holds the conversation (its write's fsync)
        added = server.post(f"/v1/conversations/{conv}/items",
                            json={"items": [{"type": "message", "role": "user", "content": f"note {i}"}]})
        assert added.status_code == 200, added.text
        turn.join()
        assert outcome["r"].status_code == 200, outcome["r"].text
        nxt = server.post("/v1/responses", json=_respond_body(server, conv, f"follow-up {i}"))
        assert nxt.status_code == 200, nxt.text
        texts = [part["text"] for item in _items(server, conv)[before:] for part in item["content"]]
        assert texts[0] == f"question {i}" and texts[2] == f"note {i}" and texts[3] == f"follow-up {i}", texts


def test_a_cut_conversation_turn_is_continued_and_edited_at_once(server: ServerProc) -> None:
    conv = server.post("/v1/conversations", json={}).json()["id"]
    for i in range(2):
        body = _respond_body(server, conv, f"long {i}", max_output_tokens=400, stream=True)
        status, data = _stream(server.url, "/v1/responses", body, {}, cut=True)
        assert status == 200 and not any(json.loads(d)["type"] == "error" for d in data), data
        edit = server.post(f"/v1/conversations/{conv}/items",  # at once, while the cut turn commits
                           json={"items": [{"type": "message", "role": "user", "content": f"edit {i}"}]})
        assert edit.status_code == 200, edit.text
        status, data = _stream(server.url, "/v1/responses", {**body, "input": f"next {i}"}, {}, cut=True)
        assert status == 200, data
