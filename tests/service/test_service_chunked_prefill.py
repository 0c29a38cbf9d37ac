"""Chunked prefill on a real server with the shipped glm-mini: a long prompt that arrives while 16
sessions stream is admitted a chunk per step beside them. Every session's tokens, the long one's
included, equal its solo run on a server that prefills prompts in one piece; and the running
streams' longest gap while the prompt is admitted is a fraction of what the one-piece prefill
makes them wait (the same scenario, in the same test, on the one-piece server)."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tests.service.serverkit import ServerProc, sse_events

SESSIONS = 16
LONG = 1500  # prompt tokens of the late request (glm-mini's context is 2048)
STREAM_TOKENS = 288  # outlasts the long prompt's admission (~94 chunk steps) however fast a step is


def _body(model: str, session: str, prompt: list[int], n: int, seed: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True, "session": session,
            "temperature": 0.8, "seed": seed, "stream": True}


def _stream(server: ServerProc, body: dict[str, Any], times: list[float]) -> list[int]:
    """Stream one completion; the arrival time of each text chunk goes to ``times``; its token ids."""
    tokens: list[int] = []
    with httpx.Client(timeout=300) as client, client.stream("POST", server.url + "/v1/completions", json=body,
                                                            headers=server.headers()) as reply:
        assert reply.status_code == 200, reply.read()
        for event in sse_events(reply):
            choice = event["choices"][0]
            if choice.get("text"):
                times.append(time.monotonic())
            tokens.extend(choice.get("token_ids") or [])
    return tokens


def _plans(model: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    short = [_body(model, f"s{i}", [30 + i, 7, 8 + i, 200 + 3 * i], STREAM_TOKENS, 100 + i) for i in range(SESSIONS)]
    long_prompt = np.random.default_rng(5).integers(10, 3000, LONG).tolist()
    return short, _body(model, "long", long_prompt, 8, 99)


def _together(server: ServerProc, prefix: str) -> tuple[dict[str, list[int]], float]:
    """The 16 streams, then the long prompt once every stream is under way: each session's tokens
    and the streams' longest gap between chunks while the long prompt was being admitted."""
    model = str(server.get("/v1/models").json()["data"][0]["id"])
    short, long_body = _plans(model)
    got: dict[str, list[int]] = {}
    times: dict[str, list[float]] = {b["session"]: [] for b in short}
    errors: list[BaseException] = []

    def run(body: dict[str, Any]) -> None:
        try:
            got[body["session"]] = _stream(server, {**body, "session": prefix + body["session"]},
                                           times[body["session"]])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(b,)) for b in short]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while min(len(v) for v in times.values()) < 10:  # every stream under way
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.01)
    sent = time.monotonic()
    long_times: list[float] = []
    got["long"] = _stream(server, {**long_body, "session": prefix + "long"}, long_times)
    admitted = long_times[0]  # its first token: the whole prompt was prefilled by then
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(v[-1] > admitted for v in times.values()), "a stream ended before the long prompt was admitted"
    gaps = [b - a for v in times.values() for a, b in zip(v, v[1:], strict=False) if b > sent and a < admitted]
    return got, max(gaps)


def test_a_long_prompt_is_admitted_in_chunks_beside_16_streams_exactly(tmp_path: Path) -> None:
    with ServerProc(tmp_path / "whole", "glm-mini", "--max-prefill-tokens", "4096", "--prefill-step-ratio", "0") \
            as server:
        model = str(server.get("/v1/models").json()["data"][0]["id"])
        short, long_body = _plans(model)
        solo = {b["session"]: _stream(server, {**b, "session": "solo-" + b["session"]}, [])
                for b in [*short, long_body]}
        whole, whole_gap = _together(server, "together-")
    with ServerProc(tmp_path / "chunked", "glm-mini", "--max-prefill-tokens", "16") as server:
        chunked, chunked_gap = _together(server, "")
        if chunked_gap * 2 >= whole_gap:
            # the longest gap is one timing on a shared two-core machine (a CI run once saw 127 ms beside
            # the other worker's SIGKILL soak): measured once more on new sessions. A prompt admitted
            # whole stalls the streams every time, so a schedule that does not chunk still fails here.
            again, chunked_gap = _together(server, "again-")
            assert again == solo
    assert whole == solo  # sharing steps changes no token
    assert chunked == solo  # nor does admitting the long prompt in chunks of 16 beside the streams
    assert all(len(v) == STREAM_TOKENS for k, v in solo.items() if k != "long")
    # in one piece, the prefill stalls every stream for its whole length; in chunks, for a step
    assert chunked_gap * 2 < whole_gap, (chunked_gap, whole_gap)
