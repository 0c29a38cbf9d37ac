"""The engine thread under real clients: a client that stops reading stalls nobody (its turn
still runs to its end and its tokens are exact), and sessions that join and leave the running
batch at different moments each decode exactly what they decode alone."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

from tests.service.serverkit import ServerProc


def _completion(server: ServerProc, model: str, session: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "session": session}
    reply = server.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return list(reply.json()["choices"][0]["token_ids"])


def _model(server: ServerProc) -> str:
    return str(server.get("/v1/models").json()["data"][0]["id"])


def test_a_client_that_stops_reading_stalls_no_one(tmp_path: Path, text_model_dir: Path) -> None:
    """A stream whose client reads nothing (a 4 KiB receive buffer, far less than the reply): the
    turn still runs to its end and commits, other sessions are served meanwhile, and the
    session's tokens are those it decodes alone."""
    n = 1200  # ~300 KB of events: more than the socket buffers and uvicorn's write buffer hold
    with ServerProc(tmp_path / "root", text_model_dir) as server:
        model = _model(server)
        want = _completion(server, model, "alone", [11, 12, 13], n)
        body = json.dumps({"model": model, "prompt": [11, 12, 13], "max_tokens": n, "ignore_eos": True,
                           "stream": True, "session": "slow"}).encode()
        host, port = server.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        try:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert sock.recv(64).startswith(b"HTTP/1.1 200")  # then this client reads nothing more
            for i in range(3):  # other sessions come and go meanwhile
                assert len(_completion(server, model, f"quick{i}", [20 + i, 5], 20)) == 20
            deadline = time.monotonic() + 120
            while server.get("/v1/sessions/slow").json()["committed"] < 3 + n - 1:
                assert time.monotonic() < deadline, "the unread stream's turn did not finish"
                time.sleep(0.2)
        finally:
            sock.close()
        history = server.get("/v1/sessions/slow", params={"history": 1}).json()["history"]
    assert history[3:] == want


def test_sessions_joining_and_leaving_the_batch_decode_exactly_as_alone(tmp_path: Path,
                                                                         text_model_dir: Path) -> None:
    # s0's long turn is still decoding when the others start (600 steps outlast a 0.18 s stagger on any
    # machine), so steps are shared however fast a step is; the others join and leave around it
    plans = [(f"s{i}", [30 + i, 7, 8 + i] * (1 + i % 3), 600 if i == 0 else 12 + 9 * (i % 4), 0.02 * i)
             for i in range(10)]
    with ServerProc(tmp_path / "alone", text_model_dir) as server:
        model = _model(server)
        alone = {name: _completion(server, model, name, prompt, n) for name, prompt, n, _ in plans}
    with ServerProc(tmp_path / "together", text_model_dir, "--max-resident", "3") as server:
        got: dict[str, list[int]] = {}
        errors: list[BaseException] = []

        def run(name: str, prompt: list[int], n: int, delay: float) -> None:
            try:
                time.sleep(delay)  # staggered: sessions join a batch already decoding
                got[name] = _completion(server, model, name, prompt, n)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=plan) for plan in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        sizes = _batch_sizes(server.get("/metrics").text)
    assert got == alone
    assert max(sizes) >= 2, sizes  # some steps really were shared


def _batch_sizes(metrics: str) -> list[float]:
    """The upper bounds of the batch-size buckets that counted any step."""
    counts: list[tuple[float, float]] = []
    for line in metrics.splitlines():
        if line.startswith("coli_decode_batch_size_bucket{"):
            bound = line.split('le="')[1].split('"')[0]
            counts.append((float("inf") if bound == "+Inf" else float(bound), float(line.split()[-1])))
    used, previous = [], 0.0
    for bound, count in counts:
        if count > previous:
            used.append(bound)
        previous = count
    return used
