"""``serve --durable-stream``: a token's text reaches the client only once its commit returned.

A real server, five sessions streaming at once (four completions on token prompts, sampled, and
one chat turn), is SIGKILLed at a random moment, several times; after each restart every byte any
client received is in that session's committed reply (read back over HTTP, then again once the
session was opened and continued). Without the flag the same test fails: the committed reply ends
up to ``--commit-every`` tokens before the text the client already has.
"""
from __future__ import annotations

import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.service.serverkit import ServerProc, StreamReader

STREAMS = 4  # completion streams, beside one chat stream
LONG = 3000  # max_tokens of every interrupted turn (never reached)
SAMPLING = {"temperature": 0.8, "top_p": 0.9}
KILLS = 3
CHAT = [{"role": "user", "content": "tell me a long story"}]


def _prompt(i: int) -> list[int]:
    return [7 + i, 40, 41 + 3 * i, 200, 9]


def _history(server: ServerProc, sid: str) -> list[int]:
    history: list[int] = server.get(f"/v1/sessions/{sid}?history=1").json()["history"]
    return history


def _kill_rounds(tmp_path: Path, text_model_dir: Path, tok: Any, durable: bool, kills: int,
                 seed: int, kill_at_text: int = 0) -> list[tuple[str, str, str]]:
    """``kills`` rounds of: stream on every session, SIGKILL at a random moment (or, with
    ``kill_at_text``, as soon as one stream has received that many pieces), restart; returns
    (session, text received, committed reply decoded) of every stream of every round."""
    rng = random.Random(seed)
    flag = "--durable-stream" if durable else "--no-durable-stream"
    server = ServerProc(tmp_path / "root", text_model_dir, "--commit-every", "16", flag).start()
    name = server.get("/v1/models").json()["data"][0]["id"]
    chat_prompt = tok.chat_ids(CHAT, add_generation_prompt=True)
    before: dict[str, list[int]] = {f"d{i}": _prompt(i) for i in range(STREAMS)}
    seen: list[tuple[str, str, str]] = []
    try:
        for round_ in range(kills):
            readers = {sid: StreamReader(server, "/v1/completions",
                                   {"model": name, "prompt": prompt, "max_tokens": LONG, "stream": True,
                                    "ignore_eos": True, "session": sid, **SAMPLING, "seed": round_ * 10 + int(sid[1])})
                       for sid, prompt in before.items()}
            readers["chat"] = StreamReader(server, "/v1/chat/completions",
                                     {"model": name, "messages": CHAT, "max_tokens": LONG, "stream": True,
                                      "session": "chat", "seed": 3, **SAMPLING})
            for reader in readers.values():
                assert reader.started.wait(60)
            if kill_at_text:  # once a client holds text: a point that the machine's speed does not move
                deadline = time.monotonic() + 60
                while max(r.events for r in readers.values()) < kill_at_text and time.monotonic() < deadline:
                    time.sleep(0.002)
            else:
                time.sleep(rng.uniform(0.0, 0.5))  # a random point of every stream
            assert server.stop(signal.SIGKILL) == -signal.SIGKILL
            for reader in readers.values():
                reader.thread.join()
            server.start()
            starts = {**{sid: len(p) for sid, p in before.items()}, "chat": len(chat_prompt)}
            for sid, reader in readers.items():
                history = _history(server, sid)
                seen.append((sid, reader.text, tok.decode(history[starts[sid]:])))
                if sid != "chat":  # the next round continues it (only the pending token fed); killed before
                    before[sid] = history or before[sid]  # its first commit, it starts again from its prompt
            # the sessions open (recovery) and continue: what the clients saw is still there
            for sid in before:
                reply = server.post("/v1/completions", json={"model": name, "prompt": before[sid], "max_tokens": 2,
                                                             "ignore_eos": True, "session": sid, **SAMPLING})
                assert reply.status_code == 200, reply.text
                assert _history(server, sid)[:len(before[sid])] == before[sid]
                before[sid] = _history(server, sid)
    finally:
        server.stop(signal.SIGKILL)
    return seen


def test_sigkill_loses_nothing_a_client_was_sent(tmp_path: Path, text_model_dir: Path,
                                                 text_model: tuple[Any, Any]) -> None:
    _, tok = text_model
    seen = _kill_rounds(tmp_path, text_model_dir, tok, durable=True, kills=KILLS, seed=26)
    assert len(seen) == KILLS * (STREAMS + 1)
    assert sum(len(text) for _, text, _ in seen) > 0
    print("durable stream, per stream: received chars, committed chars:", [(len(t), len(c)) for _, t, c in seen])
    for sid, text, committed in seen:
        assert committed.startswith(text), (sid, len(text), len(committed))


@pytest.mark.slow
def test_without_the_flag_a_kill_loses_text_a_client_was_sent(tmp_path: Path, text_model_dir: Path,
                                                              text_model: tuple[Any, Any]) -> None:
    """The control: the default commit policy (every 16 tokens) loses displayed text at a kill (made
    once a stream has shown 4 pieces, before its first commit of 16 tokens: at a random moment the
    streams could still be in their prompts under load, with nothing shown and nothing to lose)."""
    _, tok = text_model
    seen = _kill_rounds(tmp_path, text_model_dir, tok, durable=False, kills=1, seed=26, kill_at_text=4)
    assert any(not committed.startswith(text) for _, text, committed in seen)
