"""The engine core in its own process: a SIGKILL of the core mid-stream ends the running streams
with an error event, ``/healthz`` says so, the API process starts a new core within seconds, and
every session resumes from its last commit and continues exactly; a SIGKILL of the API process
leaves no core behind (it commits and exits); SIGTERM still drains and exits 0."""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service.serverkit import ServerProc
from tests.service.test_service_crash import _body, _check_exact, _continue, _stream

RESTART_WITHIN_S = 30.0  # a new core loads the model and opens the store (glm-mini: ~2-5 s here)


@pytest.fixture
def started() -> Iterator[list[ServerProc]]:
    """Servers a test starts; any still running when it ends (a failed assertion) is killed."""
    made: list[ServerProc] = []
    yield made
    for server in made:
        if server.proc is not None and server.proc.poll() is None:
            server.stop(signal.SIGKILL)


def _gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (exited, or a zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait(predicate: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_engine_sigkill_mid_stream_then_a_new_core_continues_every_session_exactly(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any], started: list[ServerProc]) -> None:
    model, _ = text_model
    # without durable streaming (a durable stream commits every token it sends: the kill soak's part)
    server = ServerProc(tmp_path / "root", text_model_dir, "--commit-every", "16", "--no-durable-stream")
    started.append(server.start())
    name = server.get("/v1/models").json()["data"][0]["id"]
    health = server.get("/healthz").json()
    core_pid, api_pid = health["engine_pid"], server.proc.pid if server.proc else 0
    assert core_pid != api_pid and health["engine_restarts"] == 0
    ids = [f"e{i}" for i in range(4)]
    events: dict[str, list[dict[str, Any]]] = {sid: [] for sid in ids}
    running = {sid: threading.Event() for sid in ids}
    threads = [_stream(server, _body(name, sid), "/v1/completions", events[sid], running[sid], 48) for sid in ids]
    for sid in ids:
        assert running[sid].wait(60)  # >= 48 tokens streamed each, so >= 32 committed (commit-every 16)
    os.kill(core_pid, signal.SIGKILL)
    for th in threads:
        th.join(60)
    for sid in ids:  # each stream ended with the API's error event (the HTTP server stayed up)
        last = events[sid][-1]
        assert "error" in last, last
        assert last["error"]["code"] == "engine_restarted"
    assert server.proc is not None and server.proc.poll() is None
    assert _wait(lambda: server.get("/healthz").status_code == 200, RESTART_WITHIN_S)
    health = server.get("/healthz").json()
    assert health["engine_restarts"] == 1 and health["engine_pid"] != core_pid
    assert _gone(core_pid)
    listed = {s["id"] for s in server.get("/v1/sessions").json()["data"]}
    assert listed == set(ids)
    for sid in ids:
        history, more = _continue(server, name, sid, 12)
        assert _check_exact(model, sid, history, more) >= 32
    metrics = server.get("/metrics").text
    assert "coli_engine_restarts_total 1.0" in metrics and "coli_decode_steps_total" in metrics
    assert server.stop() == 0


def test_api_sigkill_leaves_no_orphan_core_and_its_sessions_committed(tmp_path: Path, text_model_dir: Path,
                                                                     started: list[ServerProc]) -> None:
    # without durable streaming: what the core's drain commits is what it streamed since no commit
    server = ServerProc(tmp_path / "root", text_model_dir, "--commit-every", "1000", "--no-durable-stream")
    started.append(server.start())
    name = server.get("/v1/models").json()["data"][0]["id"]
    core_pid = server.get("/healthz").json()["engine_pid"]
    events: list[dict[str, Any]] = []
    seen = threading.Event()
    th = _stream(server, _body(name, "o1"), "/v1/completions", events, seen, 10)
    assert seen.wait(60)
    assert server.stop(signal.SIGKILL, api_only=True) == -signal.SIGKILL
    th.join(60)
    assert _wait(lambda: _gone(core_pid), 60), "the core outlived its API process"
    streamed = [e for e in events if e.get("choices")]
    server.start()  # the core drained on its parent's death: what it streamed was committed
    history = server.get("/v1/sessions/o1?history=1").json()["history"]
    assert len(history) >= 5 + len(streamed) - 1
    assert server.stop() == 0


def test_sigterm_drains_the_core_and_exits_0(tmp_path: Path, text_model_dir: Path,
                                             started: list[ServerProc]) -> None:
    server = ServerProc(tmp_path / "root", text_model_dir)
    started.append(server.start())
    core_pid = server.get("/healthz").json()["engine_pid"]
    name = server.get("/v1/models").json()["data"][0]["id"]
    reply = server.post("/v1/completions", json={"model": name, "prompt": [5, 6, 7], "max_tokens": 4,
                                                 "session": "d1"})
    assert reply.status_code == 200
    assert server.get("/v1/sessions/d1").status_code == 200
    # the API process computes nothing: after serving a turn and a session's description it holds
    # no compiled kernel (numba, llvmlite), only the engine core does
    assert server.proc is not None
    assert not _compiled_kernels(server.proc.pid)
    assert _compiled_kernels(core_pid), "the check sees nothing: the core must hold numba's libraries"
    assert server.stop(signal.SIGTERM) == 0
    assert _wait(lambda: _gone(core_pid), 30)


def _compiled_kernels(pid: int) -> set[str]:
    """The numba and llvmlite shared objects process ``pid`` has mapped."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[-1] for line in maps if "numba" in line or "llvmlite" in line}
