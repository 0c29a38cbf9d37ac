"""Stopping the server mid-stream: SIGTERM cuts every running turn at a token boundary, commits and
exits 0; SIGKILL loses only what was not committed. After a restart every session resumes from
its last commit and continues exactly as one uninterrupted in-process run does from there."""
from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import httpx

from kernels.model.sampling import Sampler
from sessionstore.sessions import reference_turns
from sessionstore.sessions.conversation_chat import ReferenceChat
from tests.service.serverkit import ServerProc, sse_events

LONG = 3000  # max_tokens of the turns that get interrupted (never reached)
SAMPLING = {"temperature": 0.8, "top_p": 0.9}


def _prompt(i: int) -> list[int]:
    return [7 + i, 40, 41 + 3 * i, 200, 9]


def _stream(server: ServerProc, body: dict[str, Any], path: str, out: list[dict[str, Any]],
            seen: threading.Event | None = None, after: int = 0) -> threading.Thread:
    """Consume one streamed request in a thread, keeping every event (until the server goes away);
    ``seen`` is set once ``after`` events arrived (the turn is running, not just queued)."""
    def run() -> None:
        try:
            with httpx.stream("POST", server.url + path, json=body, timeout=120) as response:
                for event in sse_events(response):
                    out.append(event)
                    if seen is not None and len(out) >= after:
                        seen.set()
        except httpx.HTTPError:
            pass  # SIGKILL: the connection dies mid-stream
        finally:
            if seen is not None:
                seen.set()  # never leave the test waiting (it checks what arrived)
    th = threading.Thread(target=run)
    th.start()
    return th


def _body(name: str, sid: str) -> dict[str, Any]:
    return {"model": name, "prompt": _prompt(int(sid[-1])), "max_tokens": LONG, "stream": True, "ignore_eos": True,
            "session": sid, **SAMPLING, "seed": int(sid[-1])}


def _continue(server: ServerProc, model: str, sid: str, n: int) -> tuple[list[int], list[int]]:
    """(history before, the next n tokens) of session ``sid``, continued with its whole history."""
    history = server.get(f"/v1/sessions/{sid}?history=1").json()["history"]
    body = {"model": model, "prompt": history, "max_tokens": n, "ignore_eos": True, "session": sid, **SAMPLING,
            "seed": int(sid[-1])}
    reply = server.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["session"]["reused_prefix"] == len(history) - 1  # only the pending token is fed
    return history, reply.json()["choices"][0]["token_ids"]


def _check_exact(model: Any, sid: str, history: list[int], more: list[int]) -> int:
    """``history`` is the prompt + a prefix of the uninterrupted run, ``more`` its continuation."""
    prompt = _prompt(int(sid[-1]))
    done = len(history) - len(prompt)
    want = reference_turns(model, "fp8", [(prompt, done + len(more))],
                           Sampler(**SAMPLING, seed=int(sid[-1])))[0]
    assert history == prompt + want[:done], sid
    assert more == want[done:], sid
    return done


def test_sigterm_cuts_turns_at_a_token_commits_and_exits_0(tmp_path: Path, text_model_dir: Path,
                                                            text_model: tuple[Any, Any]) -> None:
    model, tok = text_model
    # without durable streaming: the SIGTERM's own commits are what keeps the text streamed (a durable
    # stream committed it already)
    server = ServerProc(tmp_path / "root", text_model_dir, "--commit-every", "1000", "--no-durable-stream").start()
    name = server.get("/v1/models").json()["data"][0]["id"]
    ids = ["t1", "t2"]
    events: dict[str, list[dict[str, Any]]] = {sid: [] for sid in [*ids, "chat"]}
    running = {sid: threading.Event() for sid in ids}
    threads = [_stream(server, _body(name, sid), "/v1/completions", events[sid], running[sid], 10) for sid in ids]
    msgs = [{"role": "user", "content": "talk for a long time"}]
    running["chat"] = threading.Event()
    threads.append(_stream(server, {"model": name, "messages": msgs, "max_tokens": 200, "stream": True,
                                    "session": "chat", "seed": 5, "temperature": 0.0}, "/v1/chat/completions",
                           events["chat"], running["chat"], 3))
    for sid in running:
        assert running[sid].wait(60)  # every turn is decoding (commit-every 1000: nothing committed yet)
    assert server.stop(signal.SIGTERM) == 0
    for th in threads:
        th.join()
    for sid in ids:
        final = events[sid][-1]["choices"][0]
        assert final["finish_reason"] == "abort"
        got = final["token_ids"]
        assert 0 < len(got) < LONG
    server.start()
    for sid in ids:
        history, more = _continue(server, name, sid, 8)
        done = _check_exact(model, sid, history, more)
        assert done == len(events[sid][-1]["choices"][0]["token_ids"])  # everything streamed was committed
    chat_final = events["chat"][-1]["choices"][0]
    cut = chat_final["token_ids"]
    ref = ReferenceChat(model, tok, "fp8")
    assert ref.respond(msgs, len(cut)) == cut
    msgs2 = [*msgs, {"role": "assistant", "content": tok.decode(cut)}, {"role": "user", "content": "go on"}]
    reply = server.post("/v1/chat/completions", json={"model": name, "messages": msgs2, "max_tokens": 10,
                                                      "session": "chat", "temperature": 0.0}).json()
    assert reply["choices"][0]["token_ids"] == ref.respond(msgs2, 10)
    assert server.stop() == 0


def test_sigkill_mid_stream_then_every_session_resumes_exactly(tmp_path: Path, text_model_dir: Path,
                                                                text_model: tuple[Any, Any]) -> None:
    model, _ = text_model
    # without durable streaming (its point: a kill keeps the kv commits and the pending token only; a
    # durable stream keeps every token sent, test_service_durable_stream and the kill soak)
    server = ServerProc(tmp_path / "root", text_model_dir, "--commit-every", "16", "--no-durable-stream").start()
    name = server.get("/v1/models").json()["data"][0]["id"]
    ids = [f"k{i}" for i in range(4)]
    events: dict[str, list[dict[str, Any]]] = {sid: [] for sid in ids}
    running = {sid: threading.Event() for sid in ids}
    threads = [_stream(server, _body(name, sid), "/v1/completions", events[sid], running[sid], 48) for sid in ids]
    for sid in ids:
        assert running[sid].wait(60)  # >= 48 tokens streamed each, so >= 32 committed (commit-every 16)
    assert all(len(events[sid]) >= 48 for sid in ids)
    assert server.stop(signal.SIGKILL) == -signal.SIGKILL
    for th in threads:
        th.join()
    assert all(not ev or ev[-1]["choices"][0]["finish_reason"] is None for ev in events.values())  # cut, not ended
    server.start()
    listed = {s["id"] for s in server.get("/v1/sessions").json()["data"]}
    assert listed == set(ids)
    for sid in ids:
        history, more = _continue(server, name, sid, 12)
        assert _check_exact(model, sid, history, more) >= 32
    assert server.stop() == 0
