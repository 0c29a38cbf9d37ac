"""Bundles over HTTP, the pull side: ``POST /v1/sessions/{id}/pull {"from": ORIGIN}`` makes this
server fetch session ``id`` from another server (its ``GET /v1/sessions/{id}/bundle?compress=none``)
and import it as it streams. The receiving thread reads the peer's socket itself, into one large
buffer per read: no event loop and no per-piece ASGI messages stand between the wire and the
verified import (``migration.receive_bundle``: every chunk checked before it is written, then the
digests, trailer, sidecar, fsync), which is installed under the session's claim like an upload.

Off unless the server was started with ``--pull-from ORIGIN`` (repeatable): this server contacts
only those exact ``scheme://host:port`` origins, never an address taken from a request (a request
names one of them; no redirect is followed), sends ``--pull-key`` (or ``$COLI_PULL_KEY``) as their
bearer key, refuses a bundle over ``max_bundle_bytes`` before reading it, and gives up on a peer
silent for ``read_timeout_s``.
"""
from __future__ import annotations

import io
import json
import socket
import ssl
from dataclasses import dataclass
from typing import Any, BinaryIO, cast
from urllib.parse import quote, urlsplit

from kernels.errors import CorruptionError
from sessionstore.migration import ReceivedBundle, receive_bundle
from sessionstore.service.errors import ApiError
from sessionstore.service.fleet.bundle_upload import BundleHost, in_thread, too_large

HEAD_LIMIT = 64 << 10  # bytes of a peer's status line and headers at most
ERROR_BODY_LIMIT = 64 << 10  # bytes of a peer's error body read for its message
READ_BYTES = 4 << 20  # one socket read at most


def origin_of(url: str) -> str:
    """``scheme://host:port`` of an http(s) URL that is nothing but an origin; ValueError else."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// origin")
    if parts.username or parts.password or parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ValueError(f"{url!r}: give the origin alone (scheme://host:port), no path, query or user")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


@dataclass(frozen=True)
class PullPolicy:
    """Which peers this server may pull from, with what key, and how long it waits for them."""

    origins: frozenset[str]
    key: str | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    @classmethod
    def of(cls, urls: list[str], key: str | None, read_timeout_s: float = 60.0) -> PullPolicy:
        """From ``--pull-from`` values (ValueError names a bad one)."""
        return cls(frozenset(origin_of(u) for u in urls), key, read_timeout_s=read_timeout_s)

    def allowed(self, asked: object) -> str:
        """The origin a request names, if this server may pull from it (else a 4xx)."""
        if not isinstance(asked, str):
            raise ApiError(400, "'from' must be the origin of a server, e.g. http://10.0.0.2:8000", param="from")
        try:
            origin = origin_of(asked)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="from") from None
        if origin not in self.origins:
            raise ApiError(403, f"this server does not pull from {origin} (start it with --pull-from {origin})",
                           code="pull_not_allowed")
        return origin


class PeerBody(io.RawIOBase):
    """A response body of exactly ``length`` bytes read straight from ``sock`` (``first``: the bytes
    that came with the headers); a peer that closes early is a cut bundle."""

    def __init__(self, sock: socket.socket, length: int, first: bytes, where: str) -> None:
        super().__init__()
        self.sock, self.remaining, self.first, self.where = sock, length, first, where
        self.length = length

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        want = min(len(out), self.remaining, READ_BYTES)
        if want == 0:
            return 0
        if self.first:
            n = min(want, len(self.first))
            out[:n] = self.first[:n]
            self.first = self.first[n:]
        else:
            n = self.sock.recv_into(out[:want])
            if n == 0:
                raise CorruptionError(f"{self.where}: the peer closed the bundle after "
                                      f"{self.length - self.remaining} of {self.length} bytes")
        self.remaining -= n
        return n


def _connect(origin: str, policy: PullPolicy) -> socket.socket:
    parts = urlsplit(origin)
    assert parts.hostname is not None and parts.port is not None  # origin_of made it
    sock = socket.create_connection((parts.hostname, parts.port), timeout=policy.connect_timeout_s)
    sock.settimeout(policy.read_timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    if parts.scheme == "https":
        return ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
    return sock


def _read_head(sock: socket.socket, where: str) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, the body bytes read with them)."""
    got = b""
    while b"\r\n\r\n" not in got:
        if len(got) > HEAD_LIMIT:
            raise ApiError(502, f"{where}: the peer's response headers exceed {HEAD_LIMIT} bytes", code="bad_peer")
        more = sock.recv(65536)
        if not more:
            raise ApiError(502, f"{where}: the peer closed the connection before answering", code="bad_peer")
        got += more
    head, rest = got.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        raise ApiError(502, f"{where}: not an HTTP response: {lines[0][:80]!r}", code="bad_peer") from None
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, rest


def _peer_refusal(where: str, status: int, sock: socket.socket, rest: bytes) -> ApiError:
    """The peer's error as ours: its message, and 404/409 passed on; anything else is a 502."""
    body = rest
    while len(body) < ERROR_BODY_LIMIT:
        try:
            more = sock.recv(65536)
        except OSError:
            break
        if not more:
            break
        body += more
    message = body[:ERROR_BODY_LIMIT].decode("utf-8", "replace").strip()
    try:
        message = str(json.loads(message)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = message[:300]
    passed = {404: ("session_not_found", 404), 409: ("peer_busy", 409)}.get(status)
    code, ours = passed if passed is not None else ("bad_peer", 502)
    return ApiError(ours, f"{where}: the peer answered {status}: {message}", code=code)


def fetch_bundle(host: BundleHost, session_id: str, origin: str, policy: PullPolicy, limit: int) -> ReceivedBundle:
    """(a thread) Session ``session_id``'s bundle from ``origin``, verified into a temp directory."""
    where = f"{origin}/v1/sessions/{session_id}/bundle"
    try:
        sock = _connect(origin, policy)
    except OSError as exc:
        raise ApiError(502, f"{origin}: could not reach the peer: {exc}", code="peer_unreachable") from None
    try:
        netloc = urlsplit(origin).netloc
        auth = f"Authorization: Bearer {policy.key}\r\n" if policy.key else ""
        sock.sendall((f"GET /v1/sessions/{quote(session_id)}/bundle?compress=none HTTP/1.1\r\nHost: {netloc}\r\n"
                      f"{auth}Connection: close\r\n\r\n").encode())
        status, headers, rest = _read_head(sock, where)
        if status != 200:
            raise _peer_refusal(where, status, sock, rest)
        declared = headers.get("content-length", "")
        if not declared.isdigit():
            raise ApiError(502, f"{where}: the peer sent no Content-Length for an uncompressed bundle",
                           code="bad_peer")
        if int(declared) > limit:
            raise too_large(limit, declared)
        body = PeerBody(sock, int(declared), rest, where)
        try:
            received = receive_bundle(host.store, cast(BinaryIO, body), source_name=where, replace=True,
                                      model=host.model_source, as_id=session_id)
        except CorruptionError as exc:  # the peer's bundle, not our store
            raise ApiError(502, f"the bundle pulled from {where} failed verification: {exc}",
                           code="bundle_invalid") from None
        if body.remaining:
            received.discard()
            raise ApiError(502, f"{where}: {body.remaining} bytes follow the bundle's end", code="bad_peer")
        return received
    except OSError as exc:  # a reset or a silent peer (socket timeout)
        raise ApiError(502, f"{where}: {type(exc).__name__}: {exc}", code="peer_unreachable") from None
    finally:
        sock.close()


async def pull_bundle(host: BundleHost, session_id: str, asked: object, policy: PullPolicy | None, *,
                      limit: int, replace: bool) -> dict[str, Any]:
    """The whole pull: the checks, the streamed import in a thread, the install; its result."""
    if policy is None or not policy.origins:
        raise ApiError(403, "this server pulls from no peer (start it with --pull-from ORIGIN)",
                       code="pull_not_allowed")
    origin = policy.allowed(asked)
    await host.check_target(session_id, replace)
    received = await in_thread(lambda: fetch_bundle(host, session_id, origin, policy, limit))
    return await host.install(session_id, received, replace)


__all__ = ["PeerBody", "PullPolicy", "fetch_bundle", "origin_of", "pull_bundle"]
