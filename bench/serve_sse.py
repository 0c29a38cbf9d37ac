"""A lean client for many streamed completions at once: one thread, raw sockets, one selector.

Each server-sent event is timestamped the moment its last byte arrives and parsed (JSON) only
after every stream has ended, so the client's own CPU, on the same two cores as the server it
measures, stays small: 16 httpx clients in 16 threads spent about 0.45 of a core parsing events
while the server decoded (bench/serve_decode.py reports both clients' figures side by side).
"""
from __future__ import annotations

import json
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from bench.serve_procs import Streamed

RECV = 1 << 16


@dataclass
class SseStream:
    """One request on its own connection: the bytes received so far, decoded as they come."""

    sock: socket.socket
    sent: float = 0.0
    head: bytes = b""
    status: int = 0
    chunked: bool = False
    raw: bytearray = field(default_factory=bytearray)  # the body's undecoded bytes (chunk framing)
    sse: bytearray = field(default_factory=bytearray)  # decoded body bytes not yet cut into events
    events: list[tuple[float, bytes]] = field(default_factory=list)  # (arrival, event) of each event
    ended: bool = False

    def feed(self, data: bytes, now: float) -> None:
        self.raw += data
        if not self.head:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head, self.raw = bytes(self.raw[:end]), self.raw[end + 4:]
            lines = self.head.decode("latin-1").split("\r\n")
            self.status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            self.chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        if self.chunked:
            self._unchunk()
        else:
            self.sse += self.raw
            self.raw.clear()
        while (cut := self.sse.find(b"\n\n")) >= 0:
            self.events.append((now, bytes(self.sse[:cut])))
            del self.sse[:cut + 2]

    def _unchunk(self) -> None:
        while True:
            line_end = self.raw.find(b"\r\n")
            if line_end < 0:
                return
            size = int(bytes(self.raw[:line_end]).split(b";")[0], 16)
            if len(self.raw) < line_end + 2 + size + 2:
                return
            self.sse += self.raw[line_end + 2:line_end + 2 + size]
            del self.raw[:line_end + 2 + size + 2]
            if size == 0:
                self.ended = True
                return

    def streamed(self) -> Streamed:
        """The stream as bench.serve_procs.stream_completion reports it."""
        if self.status != 200:
            raise RuntimeError(f"completion: {self.status} {bytes(self.sse or self.raw)[:500]!r}")
        out = Streamed(self.sent)
        for now, event in self.events:
            if event.startswith(b"data: ") and out.event(event[len(b"data: "):], now):
                break
        return out.ended()


def _request(url: str, body: dict[str, Any]) -> bytes:
    payload = json.dumps({**body, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload


def stream_all(url: str, bodies: list[dict[str, Any]], *, timeout: float = 600.0) -> list[Streamed]:
    """Every body POSTed as a streamed ``/v1/completions`` at once (connections opened first, the
    requests sent back to back), read by one selector loop until every stream has ended."""
    parts = urlsplit(url)
    address = (parts.hostname or "127.0.0.1", parts.port or 80)
    requests = [_request(url, body) for body in bodies]
    streams = [SseStream(socket.create_connection(address, timeout=timeout)) for _ in bodies]
    selector = selectors.DefaultSelector()
    try:
        for stream in streams:
            stream.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for stream, req in zip(streams, requests, strict=True):
            stream.sent = time.perf_counter()
            stream.sock.sendall(req)
            stream.sock.setblocking(False)
            selector.register(stream.sock, selectors.EVENT_READ, stream)
        deadline = time.monotonic() + timeout
        while selector.get_map():
            ready = selector.select(timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"{len(selector.get_map())} stream(s) still open after {timeout} s")
            for key, _ in ready:
                stream = key.data
                data = stream.sock.recv(RECV)
                now = time.perf_counter()
                if data:
                    stream.feed(data, now)
                if not data or stream.ended:
                    selector.unregister(stream.sock)
    finally:
        selector.close()
        for stream in streams:
            stream.sock.close()
    return [stream.streamed() for stream in streams]


__all__ = ["stream_all"]
