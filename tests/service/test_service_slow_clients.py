"""Slow clients are cut (``--read-timeout``): headers sent a byte at a time, a JSON body trickled
or stalled; a client that connects and says nothing. Clients beside them are served as usual."""
from __future__ import annotations

import select
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from tests.service.serverkit import ServerProc

TIMEOUT_S = 2  # the server's --read-timeout here (30 by default)


def _connect(server: ServerProc) -> socket.socket:
    url = urlsplit(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    return sock


def _drip(sock: socket.socket, data: bytes, every_s: float, out: dict[str, object]) -> None:
    """Send ``data`` a byte at a time; record when the server cut us and what it answered."""
    start = time.monotonic()
    try:
        for i in range(len(data)):
            if select.select([sock], [], [], 0)[0]:  # the server answered (or closed): stop sending
                break
            sock.sendall(data[i:i + 1])
            time.sleep(every_s)
    except OSError:
        pass
    sock.settimeout(30)
    try:
        answer = sock.recv(65536)
    except OSError:
        answer = b""
    out["seconds"], out["answer"] = time.monotonic() - start, answer
    sock.close()


def test_slow_headers_trickled_and_stalled_bodies_are_cut_and_others_served(tmp_path: Path,
                                                                            text_model_dir: Path) -> None:
    with ServerProc(tmp_path / "root", text_model_dir, "--read-timeout", str(TIMEOUT_S)) as server:
        _cut_and_served(server)


def _cut_and_served(server: ServerProc) -> None:
    name = server.get("/v1/models").json()["data"][0]["id"]
    body = b'{"model": "%s", "prompt": [5, 6, 7], "max_tokens": 2}' % name.encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    runs: dict[str, dict[str, object]] = {k: {} for k in ("headers", "trickle", "stall", "silent")}
    socks = {k: _connect(server) for k in runs}
    socks["trickle"].sendall(head)
    socks["stall"].sendall(head + body[:5])
    threads = [
        threading.Thread(target=_drip, args=(socks["headers"], head * 4, 0.25, runs["headers"])),
        threading.Thread(target=_drip, args=(socks["trickle"], body, 0.25, runs["trickle"])),
        threading.Thread(target=_drip, args=(socks["stall"], b"", 0, runs["stall"])),
        threading.Thread(target=_drip, args=(socks["silent"], b"", 0, runs["silent"])),
    ]
    for th in threads:
        th.start()
    served = [server.post("/v1/completions", json={"model": name, "prompt": [5, 6, 7], "max_tokens": 2})
              for _ in range(3)]  # beside them: answered as usual
    for th in threads:
        th.join(60)
    assert all(r.status_code == 200 for r in served)
    for kind, run in runs.items():
        assert run, kind
        seconds = float(run["seconds"])  # type: ignore[arg-type]
        assert seconds < TIMEOUT_S + 6, (kind, seconds)  # cut, never left open
        answer = bytes(run["answer"])  # type: ignore[arg-type]
        if kind == "trickle":  # the body's deadline: a 408 in OpenAI's shape
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b'"code":"request_timeout"' in answer
        elif kind in ("headers", "silent"):
            assert answer == b"", answer[:200]  # closed without a word: no request ever began
    assert server.get("/healthz").status_code == 200
    assert server.stop() == 0
