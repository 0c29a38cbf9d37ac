"""bench.peer's one client: streamed completions to either server (ours, ``coli-kv serve --http``, or
llama.cpp's ``llama-server``), each event timestamped as it arrives and parsed after the streams end.

Both servers' SSE shapes are read: OpenAI's ``/v1/completions`` chunks (``choices[0].finish_reason``
null on every token's chunk; the final chunk carries it with ``token_ids`` (ours) or ``usage``
(both)) and llama.cpp's own ``/completion`` chunks (``content``, ``tokens``, ``stop``), which is the
one place llama.cpp streams the token ids (the greedy comparison needs them).
"""
from __future__ import annotations

import json
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from bench.serve_sse import SseStream

RECV = 1 << 16


class PeerError(RuntimeError):
    """A server answered with an error, or a stream broke off."""


@dataclass
class Reply:
    """One streamed completion: when it was sent, the arrival of each token-carrying event, when the
    final event came, and the tokens (ids where the server sends them)."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    done: float = 0.0
    n_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first token's event."""
        return self.token_times[0] - self.sent

    @property
    def tok_s(self) -> float:
        """Tokens per second over the whole request (sent -> final event)."""
        return self.n_tokens / (self.done - self.sent)

    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) of every gap between consecutive arrivals of token events (events that came
        in one read of the socket are one arrival)."""
        arrivals = sorted(set(self.token_times))
        return list(zip(arrivals, arrivals[1:], strict=False))


def parse_reply(sent: float, events: list[tuple[float, bytes]]) -> Reply:
    """A Reply from one stream's raw SSE events ``(arrival, b"data: ...")``."""
    out = Reply(sent)
    final: dict[str, Any] = {}
    for now, event in events:
        if not event.startswith(b"data:"):
            continue
        payload = event[len(b"data:"):].strip()
        if payload == b"[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            raise PeerError(f"the server sent an error mid-stream: {json.dumps(chunk['error'])[:300]}")
        if "choices" in chunk:  # OpenAI's shape (both servers)
            if not chunk["choices"]:  # a usage-only chunk
                final.setdefault("usage", chunk.get("usage"))
                continue
            choice = chunk["choices"][0]
            if choice.get("finish_reason") is None:
                out.token_times.append(now)
                continue
            final = {**chunk, "token_ids": choice.get("token_ids") or []}
        else:  # llama.cpp's /completion
            out.token_ids += chunk.get("tokens") or []
            if not chunk.get("stop"):
                out.token_times.append(now)
                continue
            final = {**chunk, "usage": {"completion_tokens": chunk.get("tokens_predicted")}}
        out.done = now
    if not out.done:
        raise PeerError("the stream ended without a final event")
    out.token_ids = out.token_ids or list(final.get("token_ids") or [])
    usage = final.get("usage") or {}
    out.n_tokens = int(usage.get("completion_tokens") or len(out.token_ids) or len(out.token_times))
    if not out.token_times:
        raise PeerError("the stream carried no token")
    return out


def _request(url: str, path: str, body: dict[str, Any]) -> bytes:
    payload = json.dumps({**body, "stream": True}).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload


@dataclass
class Late:
    """A request sent once stream ``watch`` has seen ``after`` token events (the stall measure's
    admission of a long prompt among running streams)."""

    body: dict[str, Any]
    watch: int = 0
    after: int = 16


def stream_many(url: str, bodies: list[dict[str, Any]], *, path: str = "/v1/completions",
                late: Late | None = None, timeout: float = 600.0) -> list[Reply]:
    """Every body POSTed streamed at once, each on its own connection (connections opened first, the
    requests sent back to back), plus ``late`` when its moment comes (its Reply last); one selector
    loop reads them all until every stream has ended."""
    parts = urlsplit(url)
    address = (parts.hostname or "127.0.0.1", parts.port or 80)
    all_bodies = [*bodies, late.body] if late else list(bodies)
    streams = [SseStream(socket.create_connection(address, timeout=timeout)) for _ in all_bodies]
    selector = selectors.DefaultSelector()

    def send(i: int) -> None:
        stream = streams[i]
        stream.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream.sent = time.perf_counter()
        stream.sock.sendall(_request(url, path, all_bodies[i]))
        stream.sock.setblocking(False)
        selector.register(stream.sock, selectors.EVENT_READ, stream)

    try:
        for i in range(len(bodies)):
            send(i)
        pending_late = late is not None
        deadline = time.monotonic() + timeout
        while selector.get_map():
            ready = selector.select(timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise PeerError(f"{len(selector.get_map())} stream(s) still open after {timeout} s")
            for key, _ in ready:
                stream = key.data
                data = stream.sock.recv(RECV)
                if data:
                    stream.feed(data, time.perf_counter())
                if not data or stream.ended:
                    selector.unregister(stream.sock)
            if pending_late and late is not None and len(streams[late.watch].events) >= late.after:
                pending_late = False
                send(len(bodies))
    finally:
        selector.close()
        for stream in streams:
            stream.sock.close()
    for stream in streams:
        if stream.status != 200:
            raise PeerError(f"HTTP {stream.status}: {bytes(stream.sse or stream.raw)[:300]!r}")
    return [parse_reply(stream.sent, stream.events) for stream in streams]


def stream_one(url: str, body: dict[str, Any], *, path: str = "/v1/completions") -> Reply:
    """One streamed request, alone."""
    return stream_many(url, [body], path=path)[0]


__all__ = ["Late", "PeerError", "Reply", "parse_reply", "stream_many", "stream_one"]
