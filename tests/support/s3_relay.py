"""A TCP relay for fault tests of the object-store tier: 127.0.0.1:<port> -> an S3 server.

It forwards bytes both ways and reads the head of each HTTP request the client sends, so that a
test's ``rule(request) -> action`` can act on one request: ``PASS`` it, ``HOLD`` it (nothing is
forwarded until :meth:`Relay.release`), take the store ``DOWN`` in the middle of it (the head and
part of the body reach the server, then every connection is cut and nothing listens until
:meth:`Relay.up`), or ``LOSE_ANSWER`` (the request reaches the server whole, its answer is
dropped and the connection cut: a write that landed without its client knowing).
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

PASS, HOLD, DOWN, LOSE_ANSWER = "pass", "hold", "down", "lose-answer"
HEAD_LIMIT = 64 << 10


@dataclass(frozen=True)
class Request:
    """The head of one request as the relay saw it (``headers`` keys lower-cased)."""

    method: str
    path: str
    headers: dict[str, str]


Rule = Callable[[Request], str]


class Relay:
    """Relay 127.0.0.1:``port`` to ``target`` (host, port); see the module doc."""

    def __init__(self, target: tuple[str, int], rule: Rule | None = None) -> None:
        self.target = target
        self.rule: Rule = rule or (lambda _req: PASS)
        self.seen: list[Request] = []
        self.held = threading.Event()  # set when a request is being held
        self._gate = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = 0
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- the store up and down ----------------------------------------------------------------
    def up(self) -> None:
        """Listen (again, on the same port once it was chosen)."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def down(self) -> None:
        """Stop listening and cut every open connection: the store is gone."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            _close(listener)
        for conn in conns:
            _close(conn)

    def release(self) -> None:
        """Let held requests through (and every later one a rule holds)."""
        self._gate.set()

    def rearm(self) -> None:
        """Hold again: the next request a rule holds waits for the next :meth:`release`."""
        self._gate.clear()
        self.held.clear()

    def close(self) -> None:
        self.release()
        self.down()

    # --- pumping --------------------------------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:
                    _close(client)
                    _close(upstream)
                    return
                self._conns.update((client, upstream))
            mute = threading.Event()
            threading.Thread(target=self._requests, args=(client, upstream, mute), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, client, mute), daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket, mute: threading.Event) -> None:
        buf = b""
        body_left = 0
        down_at = -1  # DOWN: cut everything once the body has this many bytes left
        raw = False  # a body of unknown length (chunked): forward the rest as it comes
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if raw:
                    dst.sendall(data)
                    continue
                buf += data
                while buf:
                    if body_left:
                        part, buf = buf[:body_left - max(down_at, 0)], buf[body_left - max(down_at, 0):]
                        dst.sendall(part)
                        body_left -= len(part)
                        if body_left == down_at:
                            self.down()
                            return
                        continue
                    end = buf.find(b"\r\n\r\n")
                    if end < 0:
                        if len(buf) > HEAD_LIMIT:
                            raw = True
                            dst.sendall(buf)
                            buf = b""
                        break
                    head, buf = buf[:end + 4], buf[end + 4:]
                    req = _parse(head)
                    self.seen.append(req)
                    length = int(req.headers.get("content-length", "0") or 0)
                    raw = "chunked" in req.headers.get("transfer-encoding", "")
                    action = self.rule(req)
                    if action == HOLD:
                        self.held.set()
                        self._gate.wait(60)
                    if action == DOWN:  # half the body reaches the server, then nothing
                        if length < 2:
                            dst.sendall(head)
                            self.down()
                            return
                        down_at = length - length // 2
                    if action == LOSE_ANSWER:
                        mute.set()
                    dst.sendall(head)
                    body_left = length
                    if raw:
                        dst.sendall(buf)
                        buf = b""
        except OSError:
            pass
        _close(src)
        _close(dst)

    def _answers(self, src: socket.socket, dst: socket.socket, mute: threading.Event) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if mute.is_set():  # the request landed; its answer never reaches the client
                    break
                dst.sendall(data)
        except OSError:
            pass
        _close(src)
        _close(dst)


def _parse(head: bytes) -> Request:
    lines = head.decode("latin-1").split("\r\n")
    method, _, rest = lines[0].partition(" ")
    path = rest.rsplit(" ", 1)[0]
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return Request(method, path, headers)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


__all__ = ["DOWN", "HOLD", "LOSE_ANSWER", "PASS", "Relay", "Request"]
