"""A light HTTP/1.1 client for bundle moves between two servers: raw sockets, no parser
library, no body copies in user space where the kernel can move the bytes itself.

``pipe_bundle`` is A's ``GET /v1/sessions/ID/bundle`` streamed into B's ``PUT``: A answers with
the bundle's exact ``Content-Length`` (uncompressed on loopback, FORMAT.md 7), so the PUT declares
the same length and its body is A's body, moved socket to socket with ``os.splice`` through a
kernel pipe (or, without splice, ``recv_into`` one buffer and ``sendall`` it). ``get_bundle`` and
``put_bundle`` are the two halves alone (drained to nothing, sent from a file with ``sendfile``).
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

BUF = 1 << 20
HEAD_LIMIT = 64 << 10
F_SETPIPE_SZ = 1031  # fcntl: set a pipe's capacity (Linux)


@dataclass
class Answer:
    """One HTTP response's status, headers (lower-case names) and, once read, its body."""

    status: int
    headers: dict[str, str]
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=600)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def request_head(method: str, url: str, path: str, length: int | None = None) -> bytes:
    host = urlsplit(url).netloc
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    if length is not None:
        lines += ["Content-Type: application/octet-stream", f"Content-Length: {length}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_head(sock: socket.socket) -> Answer:
    """The status line and headers, and not one byte of the body (peeked, then consumed)."""
    while True:
        seen = sock.recv(HEAD_LIMIT, socket.MSG_PEEK)
        if not seen:
            raise ConnectionError("the server closed the connection before answering")
        end = seen.find(b"\r\n\r\n")
        if end >= 0:
            break
        if len(seen) >= HEAD_LIMIT:
            raise ConnectionError("response head over 64 KiB")
        time.sleep(0.0005)
    head = sock.recv(end + 4)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return Answer(status, headers)


def read_body(sock: socket.socket, answer: Answer) -> Answer:
    """The rest of a (small) response body: by Content-Length, else to the connection's end."""
    parts, want = [], int(answer.headers.get("content-length", -1))
    got = 0
    while want < 0 or got < want:
        piece = sock.recv(BUF)
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
    answer.body = b"".join(parts)
    return answer


def _retry(sock: socket.socket, write: bool, *args: int) -> int:
    """``os.splice(*args)`` on a socket with a timeout (non-blocking underneath): wait while it
    would block."""
    while True:
        try:
            return os.splice(*args)
        except BlockingIOError:
            ready = select.select([], [sock], [], sock.gettimeout()) if write else \
                select.select([sock], [], [], sock.gettimeout())
            if not any(ready):
                raise TimeoutError(f"the socket stayed silent for {sock.gettimeout()} s") from None


def _splice_body(src: socket.socket, dst: socket.socket, n: int) -> int:
    """Move n bytes src -> dst through a kernel pipe; the bytes moved (fewer: src ended)."""
    r, w = os.pipe()
    try:
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, BUF)
        except OSError:  # a smaller pipe still works
            pass
        moved = 0
        while moved < n:
            k = _retry(src, False, src.fileno(), w, min(BUF, n - moved))
            if not k:
                break
            left = k
            while left:
                left -= _retry(dst, True, r, dst.fileno(), left)
            moved += k
        return moved
    finally:
        os.close(r)
        os.close(w)


def _copy_body(src: socket.socket, dst: socket.socket, n: int) -> int:
    """Move n bytes src -> dst through one reused user-space buffer."""
    buf = memoryview(bytearray(BUF))
    moved = 0
    while moved < n:
        k = src.recv_into(buf, min(BUF, n - moved))
        if not k:
            break
        dst.sendall(buf[:k])
        moved += k
    return moved


def pipe_bundle(a_url: str, b_url: str, session: str, *, splice: bool = True) -> tuple[float, int, Answer]:
    """A's bundle GET streamed into B's PUT; (seconds, body bytes, B's answer with its body)."""
    path = f"/v1/sessions/{session}/bundle"
    t0 = time.perf_counter()
    with connect(a_url) as src, connect(b_url) as dst:
        src.sendall(request_head("GET", a_url, path))
        got = read_head(src)
        if got.status != 200 or "content-length" not in got.headers:
            raise RuntimeError(f"GET bundle: {got.status} {read_body(src, got).body[:300]!r}")
        n = int(got.headers["content-length"])
        dst.sendall(request_head("PUT", b_url, path, n))
        move = _splice_body if splice and hasattr(os, "splice") else _copy_body
        moved = move(src, dst, n)
        if moved != n:
            raise RuntimeError(f"GET bundle: the body ended after {moved} of {n} bytes")
        answer = read_body(dst, read_head(dst))
    took = time.perf_counter() - t0
    if answer.status != 200:
        raise RuntimeError(f"PUT bundle: {answer.status} {answer.body[:300]!r}")
    return took, n, answer


def get_bundle(a_url: str, session: str, sink: str | None = None) -> tuple[float, int]:
    """A's bundle GET read whole (into ``sink``, a file path, or dropped); (seconds, bytes)."""
    path = f"/v1/sessions/{session}/bundle"
    buf = memoryview(bytearray(BUF))
    t0 = time.perf_counter()
    with connect(a_url) as src:
        src.sendall(request_head("GET", a_url, path))
        got = read_head(src)
        if got.status != 200:
            raise RuntimeError(f"GET bundle: {got.status} {read_body(src, got).body[:300]!r}")
        n, moved = int(got.headers["content-length"]), 0
        fd = os.open(sink, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if sink else -1
        try:
            while moved < n:
                k = src.recv_into(buf, min(BUF, n - moved))
                if not k:
                    raise RuntimeError(f"GET bundle: the body ended after {moved} of {n} bytes")
                if fd >= 0:
                    os.write(fd, buf[:k])
                moved += k
        finally:
            if fd >= 0:
                os.close(fd)
    return time.perf_counter() - t0, n


def put_bundle(b_url: str, session: str, bundle: str) -> tuple[float, Answer]:
    """A bundle file sent as B's PUT body with ``sendfile``; (seconds, B's answer)."""
    path = f"/v1/sessions/{session}/bundle"
    n = os.path.getsize(bundle)
    t0 = time.perf_counter()
    with connect(b_url) as dst, open(bundle, "rb") as f:
        dst.sendall(request_head("PUT", b_url, path, n))
        dst.sendfile(f)
        answer = read_body(dst, read_head(dst))
    took = time.perf_counter() - t0
    if answer.status != 200:
        raise RuntimeError(f"PUT bundle: {answer.status} {answer.body[:300]!r}")
    return took, answer


def httpx_pipe(a_url: str, b_url: str, session: str, piece: int = BUF) -> tuple[float, int]:
    """The same move through one httpx client (its stream re-cut into ``piece`` bytes, sent as
    a chunked PUT): the pipe bench/serve.py used before; (seconds, body bytes)."""
    import httpx

    path, sent = f"/v1/sessions/{session}/bundle", 0
    with httpx.Client(timeout=600) as client:
        t0 = time.perf_counter()
        with client.stream("GET", a_url + path) as got:
            if got.status_code != 200:
                raise RuntimeError(f"GET bundle: {got.status_code} {got.read()[:300]!r}")

            def body() -> Iterator[bytes]:
                nonlocal sent
                for chunk in got.iter_raw(piece):
                    sent += len(chunk)
                    yield chunk

            put = client.put(b_url + path, content=body())
        took = time.perf_counter() - t0
    if put.status_code != 200:
        raise RuntimeError(f"PUT bundle: {put.status_code} {put.text[:300]}")
    return took, sent


__all__ = ["Answer", "get_bundle", "httpx_pipe", "pipe_bundle", "put_bundle"]
