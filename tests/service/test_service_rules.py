"""The service's rules over a real server: a busy session refuses a second request with 409 (never
interleaved); bearer auth; every bad input is a 4xx in OpenAI's error shape and the server stays
up; the sessions API (info, history, fork, suspend, delete); metrics; the bind rule."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessionstore.sessions import SessionStore
from tests.service.serverkit import REPO, ServerProc, sse_events


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, text_model_dir: Path) -> Any:
    root = tmp_path_factory.mktemp("rules") / "root"
    SessionStore(root).create("other", "tiny").close()  # a session of another model
    with ServerProc(root, text_model_dir) as proc:
        proc.model_id = proc.get("/v1/models").json()["data"][0]["id"]
        yield proc


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return dict(err)


def test_busy_session_gets_409_until_its_turn_ends(server: ServerProc) -> None:
    body = {"model": server.model_id, "prompt": [5, 6, 7], "max_tokens": 4000, "stream": True, "ignore_eos": True,
            "session": "busy"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        events = sse_events(response)
        next(events)  # the turn is running: its first token arrived
        second = server.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        err = _error(second, 409)
        assert err["code"] == "session_busy" and "busy" in err["message"]
        assert _error(server.post("/v1/sessions/busy/suspend"), 409)["code"] == "session_busy"
        other = server.post("/v1/completions", json={**body, "session": None, "stream": False, "max_tokens": 2})
        assert other.status_code == 200, other.text  # other work runs meanwhile, in the same decode steps
        metrics = server.get("/metrics").text.splitlines()
        alone = [ln for ln in metrics if ln.startswith('coli_decode_batch_size_bucket{le="1.0"}')]
        total = [ln for ln in metrics if ln.startswith("coli_decode_batch_size_count")]
        assert float(total[0].split()[-1]) > float(alone[0].split()[-1])  # some step advanced both
    # the client went away: the turn ends at its next token and commits; then the session is free
    deadline = time.monotonic() + 60
    while True:
        again = server.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        if again.status_code != 409 or time.monotonic() > deadline:
            break
    assert again.status_code == 200, again.text
    info = server.get("/v1/sessions/busy").json()
    assert 3 < info["tokens"] < 4000  # cut by the disconnect, far before its 4000 tokens


def test_auth(tmp_path: Path, text_model_dir: Path) -> None:
    import openai

    with ServerProc(tmp_path / "root", text_model_dir, "--api-key", "sekrit") as srv:
        assert httpx.get(srv.url + "/healthz").status_code == 200  # health needs no key
        assert _error(httpx.get(srv.url + "/v1/models"), 401)["type"] == "authentication_error"
        assert httpx.get(srv.url + "/v1/sessions", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert srv.get("/v1/models").status_code == 200
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        assert srv.openai().models.list().data


def test_non_loopback_bind_needs_a_key(tmp_path: Path, text_model_dir: Path) -> None:
    cmd = [sys.executable, "-m", "tools", "serve", "--http", "0.0.0.0:0", "--root", str(tmp_path / "r"),
           "--model", str(text_model_dir)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "COLI_LOG": "off"})
    assert done.returncode != 0
    assert "refusing to listen on 0.0.0.0" in done.stderr and "Traceback" not in done.stderr


def test_bad_inputs_are_4xx_and_the_server_stays_up(server: ServerProc) -> None:
    m = server.model_id
    chat = {"model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def post(body: Any, path: str = "/v1/chat/completions", **kw: Any) -> httpx.Response:
        return server.post(path, json=body, **kw) if not isinstance(body, bytes) else server.post(path, content=body)

    assert _error(post(b"x" * (5 << 20)), 413)["code"] == "body_too_large"
    assert _error(post(b'{"model": "x", "messages": ['), 400)["code"] == "invalid_json"
    assert _error(post(b"[1, 2]"), 400)["code"] == "invalid_json"
    assert _error(post({**chat, "messages": [{"role": "user", "content": "x"}] * 1025}), 400)["param"] == "messages"
    assert _error(post({**chat, "messages": []}), 400)["param"] == "messages"
    assert _error(post({**chat, "messages": [{"role": "wizard", "content": "x"}]}), 400)["param"].startswith("messages")
    assert _error(post({**chat, "max_tokens": 0}), 400)["param"] == "max_tokens"
    assert _error(post({**chat, "max_tokens": 4097}), 400)["param"] == "max_tokens"
    overflow = {**chat, "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4096}
    assert "context" in _error(post(overflow), 400)["message"]
    assert "context" in _error(post({**overflow, "session": "ovf"}), 400)["message"]
    assert server.get("/v1/sessions/ovf").status_code == 404  # a refused first turn leaves no session
    assert _error(post({**chat, "model": "gpt-4"}), 404)["code"] == "model_not_found"
    assert _error(post({**chat, "session": "../escape"}), 400)["message"].startswith("invalid session id")
    assert _error(post({**chat, "session": "x" * 5000}), 400)
    assert _error(post({**chat, "temperature": -1}), 400)
    assert _error(post({**chat, "n": 9}), 400)["param"] == "n"
    assert _error(post({**chat, "stop": ["a"] * 5}), 400)["param"] == "stop"
    assert _error(post({**chat, "session": "other"}), 409)["code"] == "model_mismatch"
    assert _error(post({"model": m, "prompt": [1, 100000], "max_tokens": 2}, "/v1/completions"), 400)
    assert _error(post({"model": m, "prompt": [], "max_tokens": 2}, "/v1/completions"), 400)["param"] == "prompt"
    assert _error(server.get("/v1/sessions/nope"), 404)["code"] == "session_not_found"
    assert _error(server.get("/v1/sessions/bad%20id"), 400)
    assert server.get("/v1/sessions/..%2F..%2Fetc").status_code in (400, 404)
    assert _error(server.post("/v1/sessions/nope/suspend"), 404)
    assert _error(server.post("/v1/sessions/other/fork", json={"new": "../x"}), 400)
    assert _error(httpx.delete(server.url + "/v1/sessions/nope"), 404)
    assert _error(server.get("/v1/nothing"), 404)
    assert server.get("/healthz").json()["status"] == "ok"
    assert not (Path(server.root) / "sessions" / "escape").exists()
    ids = {s["id"] for s in server.get("/v1/sessions").json()["data"]}
    assert "x" * 5000 not in ids and "../escape" not in ids


def test_sessions_api_fork_suspend_delete_and_metrics(server: ServerProc) -> None:
    m = server.model_id
    body = {"model": m, "messages": [{"role": "user", "content": "fork me"}], "max_tokens": 6, "session": "src"}
    first = server.post("/v1/chat/completions", json=body).json()
    history = server.get("/v1/sessions/src?history=1").json()["history"]
    assert history[-len(first["choices"][0]["token_ids"]):] == first["choices"][0]["token_ids"]
    fork = server.post("/v1/sessions/src/fork", json={"new": "copy"})
    assert fork.status_code == 200 and fork.json()["tokens"] == len(history)
    assert server.get("/v1/sessions/copy?history=1").json()["history"] == history
    cut = server.post("/v1/sessions/src/fork", json={"new": "cut", "at": 3}).json()
    assert cut["committed"] == 3
    assert _error(server.post("/v1/sessions/src/fork", json={"new": "copy"}), 409)["code"] == "session_exists"
    # the fork carries the conversation: the same next turn on either gives the same tokens
    nxt = [*body["messages"], {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
           {"role": "user", "content": "again"}]
    a = server.post("/v1/chat/completions", json={**body, "messages": nxt}).json()
    b = server.post("/v1/chat/completions", json={**body, "messages": nxt, "session": "copy"}).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["session"]["reused_prefix"] == b["session"]["reused_prefix"] > 0
    assert server.post("/v1/sessions/copy/suspend").json()["state"] == "suspended"
    deleted = httpx.delete(server.url + "/v1/sessions/copy")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert server.get("/v1/sessions/copy").status_code == 404
    metrics = server.get("/metrics").text
    for name in ("coli_tokens_generated_total", "coli_requests_total", "coli_sessions_resident",
                 "coli_resident_kv_bytes", "coli_commit_seconds_bucket", "coli_resume_seconds_bucket"):
        assert name in metrics, name
    tokens = [line for line in metrics.splitlines() if line.startswith("coli_tokens_generated_total")]
    assert float(tokens[0].split()[-1]) >= 18
    assert 'coli_requests_total{endpoint="chat",status="200"}' in metrics


def test_stop_strings_end_the_reply_before_them(server: ServerProc) -> None:
    chat = {"model": server.model_id, "messages": [{"role": "user", "content": "stop somewhere"}],
            "max_tokens": 40, "temperature": 0.0}
    full = server.post("/v1/chat/completions", json=chat).json()["choices"][0]
    text = full["message"]["content"]
    assert len(text) >= 8, text  # the greedy reply of the test model is long enough to cut
    stop = text[4:6]
    cut = server.post("/v1/chat/completions", json={**chat, "stop": [stop, "\x00never"]}).json()["choices"][0]
    assert cut["message"]["content"] == text[:text.index(stop)]
    assert cut["finish_reason"] == "stop"
    assert cut["token_ids"] == full["token_ids"][:len(cut["token_ids"])]  # the same tokens, ended at the stop
    events = list(sse_events(httpx.post(server.url + "/v1/chat/completions", json={**chat, "stop": stop,
                                                                                    "stream": True})))
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert streamed == text[:text.index(stop)] and events[-1]["choices"][0]["finish_reason"] == "stop"


def test_max_kv_bytes_suspends_the_least_recently_used_idle_session(tmp_path: Path, text_model_dir: Path) -> None:
    with ServerProc(tmp_path / "root", text_model_dir, "--max-kv-bytes", "1") as srv:
        name = srv.get("/v1/models").json()["data"][0]["id"]
        for sid in ("a", "b"):
            body = {"model": name, "prompt": [3, 4, 5], "max_tokens": 3, "session": sid}
            assert srv.post("/v1/completions", json=body).status_code == 200
        states = {s["id"]: s["state"] for s in srv.get("/v1/sessions").json()["data"]}
        assert states == {"a": "suspended", "b": "resident"}  # b, in use, is kept even past the budget
