"""Bundles over HTTP, the pull side: ``POST /v1/sessions/{id}/pull {"from": ORIGIN}`` makes this
server fetch session ``id`` from another server (its ``GET /v1/sessions/{id}/bundle?compress=none``)
and import it as it streams. The receiving thread reads the peer's response itself, through one
httpx client (the HTTP client of every bundle transfer, as :mod:`sessionstore.migration.http_transport`'s),
as it arrives: no event loop and no per-piece ASGI messages stand between the wire and the
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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, cast
from urllib.parse import quote, urlsplit

import httpx

from kernels.errors import CorruptionError
from sessionstore.migration import ReceivedBundle, receive_bundle
from sessionstore.service.errors import ApiError
from sessionstore.service.fleet.bundle_upload import BundleHost, in_thread, too_large

ERROR_BODY_LIMIT = 64 << 10  # bytes of a peer's error body read for its message


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
    """A response body of exactly ``length`` bytes, read from the peer's raw stream (``pieces``:
    the body as it arrives, nothing decoded); a peer that closes early is a cut bundle."""

    def __init__(self, pieces: Iterator[bytes], length: int, where: str) -> None:
        super().__init__()
        self.pieces, self.remaining, self.where = pieces, length, where
        self.length = length
        self.left = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        want = min(len(out), self.remaining)
        if want == 0:
            return 0
        while not self.left:
            try:
                self.left = memoryview(next(self.pieces))
            except (StopIteration, httpx.RemoteProtocolError):  # closed before Content-Length bytes came
                raise CorruptionError(f"{self.where}: the peer closed the bundle after "
                                      f"{self.length - self.remaining} of {self.length} bytes") from None
        n = min(want, len(self.left))
        out[:n] = self.left[:n]
        self.left = self.left[n:]
        self.remaining -= n
        return n


def peer_client(policy: PullPolicy) -> httpx.Client:
    """The client of one pull: ``policy``'s key and timeouts, no redirect followed, no proxy
    from the environment (only the listed origin is contacted, directly)."""
    headers = {"Authorization": f"Bearer {policy.key}"} if policy.key else {}
    timeout = httpx.Timeout(policy.read_timeout_s, connect=policy.connect_timeout_s)
    return httpx.Client(headers=headers, timeout=timeout, follow_redirects=False, trust_env=False)


def _peer_refusal(where: str, response: httpx.Response) -> ApiError:
    """The peer's error as ours: its message, and 404/409 passed on; anything else is a 502."""
    body = b""
    try:
        for piece in response.iter_raw():
            body += piece
            if len(body) >= ERROR_BODY_LIMIT:
                break
    except httpx.HTTPError:
        pass
    message = body[:ERROR_BODY_LIMIT].decode("utf-8", "replace").strip()
    try:
        message = str(json.loads(message)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = message[:300]
    status = response.status_code
    passed = {404: ("session_not_found", 404), 409: ("peer_busy", 409)}.get(status)
    code, ours = passed if passed is not None else ("bad_peer", 502)
    return ApiError(ours, f"{where}: the peer answered {status}: {message}", code=code)


def fetch_bundle(host: BundleHost, session_id: str, origin: str, policy: PullPolicy, limit: int) -> ReceivedBundle:
    """(a thread) Session ``session_id``'s bundle from ``origin``, verified into a temp directory."""
    where = f"{origin}/v1/sessions/{session_id}/bundle"
    url = f"{origin}/v1/sessions/{quote(session_id, safe='')}/bundle?compress=none"
    with peer_client(policy) as client:
        try:
            response = client.send(client.build_request("GET", url), stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ApiError(502, f"{origin}: could not reach the peer: {exc}", code="peer_unreachable") from None
        except httpx.RemoteProtocolError as exc:  # closed before answering, or not HTTP (headers past h11's limit)
            raise ApiError(502, f"{where}: not an HTTP response: {exc}", code="bad_peer") from None
        except httpx.HTTPError as exc:  # a reset or a silent peer before the answer
            raise ApiError(502, f"{where}: {type(exc).__name__}: {exc}", code="peer_unreachable") from None
        try:
            if response.status_code != 200:
                raise _peer_refusal(where, response)
            declared = response.headers.get("content-length", "")
            if not declared.isdigit():
                raise ApiError(502, f"{where}: the peer sent no Content-Length for an uncompressed bundle",
                               code="bad_peer")
            if int(declared) > limit:
                raise too_large(limit, declared)
            body = PeerBody(response.iter_raw(), int(declared), where)  # the pieces as read, none copied twice
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
        except httpx.HTTPError as exc:  # a reset or a silent peer (read timeout) mid-body
            raise ApiError(502, f"{where}: {type(exc).__name__}: {exc}", code="peer_unreachable") from None
        finally:
            response.close()


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


__all__ = ["PeerBody", "PullPolicy", "fetch_bundle", "origin_of", "peer_client", "pull_bundle"]
