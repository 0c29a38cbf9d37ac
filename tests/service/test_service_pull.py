"""A server pulls a session from another (POST /v1/sessions/ID/pull): the bundle read straight
from the peer's socket and verified before install, the session continuing exactly; only the
peers named by --pull-from are ever contacted, with --pull-key, and every refusal is one 4xx/5xx
JSON error with the target store unchanged."""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from kernels.model.sampling import Sampler
from sessionstore.service.errors import ApiError
from sessionstore.service.fleet.bundle_pull import PullPolicy, origin_of
from sessionstore.sessions import reference_turns
from tests.service.serverkit import ServerProc


def test_origins_are_exact_and_only_listed_ones_are_pulled_from() -> None:
    assert origin_of("http://127.0.0.1:8001") == "http://127.0.0.1:8001"
    assert origin_of("http://Example.com") == "http://example.com:80"
    assert origin_of("https://[::1]:9/") == "https://[::1]:9"
    for bad in ("ftp://x:1", "http://x:1/v1/sessions", "http://u:p@x:1", "http://x:1?a=1", "x:1", ""):
        with pytest.raises(ValueError):
            origin_of(bad)
    policy = PullPolicy.of(["http://127.0.0.1:8001"], "k")
    assert policy.allowed("http://127.0.0.1:8001/") == "http://127.0.0.1:8001"
    for asked, status in (("http://127.0.0.1:8002", 403), ("http://localhost:8001", 403), ("file:///etc", 400),
                          (7, 400)):
        with pytest.raises(ApiError) as info:
            policy.allowed(asked)
        assert info.value.status == status


def _error(response: Any) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def test_a_pulled_session_continues_exactly_and_refusals_leave_nothing(tmp_path: Path, text_model_dir: Path,
                                                                       text_model: tuple[Any, Any]) -> None:
    model, _ = text_model
    silent = socket.socket()  # a peer that accepts and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    quiet = f"http://127.0.0.1:{silent.getsockname()[1]}"
    with ServerProc(tmp_path / "a", text_model_dir, "--api-key", "key-a") as a:
        pulls_from_a = ("--pull-from", a.url, "--pull-key", "key-a")
        also_quiet = ("--pull-from", quiet, "--pull-timeout", "2")
        with ServerProc(tmp_path / "b", text_model_dir, *pulls_from_a, *also_quiet) as b, \
                ServerProc(tmp_path / "c", text_model_dir, *pulls_from_a, "--max-bundle-bytes", "1000") as c, \
                ServerProc(tmp_path / "d", text_model_dir, "--pull-from", a.url) as d:
            name = a.get("/v1/models").json()["data"][0]["id"]
            body = {"model": name, "prompt": [9, 8, 7, 6], "max_tokens": 12, "ignore_eos": True, "session": "mv"}
            first = a.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]

            assert _error(b.post("/v1/sessions/mv/pull", json={"from": "http://127.0.0.1:1"})) == \
                (403, "pull_not_allowed")  # never contacted: not a listed peer
            assert _error(b.post("/v1/sessions/mv/pull", json={"from": a.url + "/x"}))[0] == 400
            assert _error(b.post("/v1/sessions/mv/pull", json={"to": a.url}))[0] == 400
            assert _error(b.post("/v1/sessions/nope/pull", json={"from": a.url})) == (404, "session_not_found")
            assert _error(c.post("/v1/sessions/mv/pull", json={"from": a.url})) == (413, "body_too_large")
            assert _error(d.post("/v1/sessions/mv/pull", json={"from": a.url})) == (502, "bad_peer")  # a: 401
            assert _error(b.post("/v1/sessions/q/pull", json={"from": quiet})) == (502, "peer_unreachable")
            for server in (b, c, d):
                assert server.get("/v1/sessions").json()["data"] == []
                assert not list((server.root / "tmp").iterdir())  # no temp directory left

            pulled = b.post("/v1/sessions/mv/pull", json={"from": a.url})
            assert pulled.status_code == 200, pulled.text
            assert pulled.json()["tokens"] == 4 + len(first)
            history = b.get("/v1/sessions/mv?history=1").json()["history"]
            more = b.post("/v1/completions", json={**body, "prompt": history, "max_tokens": 6}).json()
            want = reference_turns(model, "fp8", [([9, 8, 7, 6], 12), (None, 6)], Sampler())
            assert first == want[0] and more["choices"][0]["token_ids"] == want[1]
            assert _error(b.post("/v1/sessions/mv/pull", json={"from": a.url})) == (409, "session_live")
            assert b.post("/v1/sessions/mv/suspend").status_code == 200
            assert _error(b.post("/v1/sessions/mv/pull", json={"from": a.url, "replace": False})) == \
                (409, "session_exists")
            assert b.stop() == 0 and c.stop() == 0 and d.stop() == 0
        assert a.stop() == 0
    silent.close()


@pytest.mark.parametrize("flags", [["--pull-from", "ftp://x:1"], ["--pull-from", "http://x:1/path"],
                                   ["--pull-from", "http://x:1", "--pull-timeout", "0"]])
def test_a_bad_pull_flag_is_one_error_line(tmp_path: Path, flags: list[str]) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tools", "serve", "--http", "127.0.0.1:0", "--root",
                          str(tmp_path / "r"), "--model", "tiny", *flags], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "pull" in out.stderr, out.stderr


def _one_answer_peer(answer: bytes) -> tuple[str, Any]:
    """A peer on loopback that answers one request with ``answer`` and closes; (origin, its thread)."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{server.getsockname()[1]}", thread


@pytest.mark.parametrize(("answer", "status", "code"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1400\r\n\r\n" + b"x" * 10, 502, "bundle_invalid"),  # cut short
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 502, "bad_peer"),  # no length
    (b"HTTP/1.1 409 Conflict\r\nContent-Length: 38\r\n\r\n" + b'{"error": {"message": "it is in use"}}',
     409, "peer_busy"),
    (b"SSH-2.0-not-http\r\n\r\n", 502, "bad_peer"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2000\r\n\r\n", 413, "body_too_large"),  # over the limit, unread
])
def test_a_peer_that_misbehaves_is_one_error_and_leaves_nothing(tmp_path: Path, answer: bytes, status: int,
                                                                 code: str) -> None:
    from sessionstore.service.fleet.bundle_pull import fetch_bundle
    from sessionstore.service.fleet.bundle_upload import BundleHost
    from sessionstore.sessions import SessionStore

    store = SessionStore(tmp_path / "r")
    origin, thread = _one_answer_peer(answer)
    policy = PullPolicy.of([origin], "k", read_timeout_s=5)
    with pytest.raises(ApiError) as info:
        fetch_bundle(BundleHost(store, "tiny", None), "s", origin, policy, limit=1500)  # type: ignore[arg-type]
    assert (info.value.status, info.value.code) == (status, code), info.value
    assert "Traceback" not in str(info.value) and str(tmp_path) not in str(info.value)
    tmp = store.root / "tmp"
    assert not tmp.exists() or not list(tmp.iterdir())
    thread.join(5)
