"""Bundles to and from a ``coli-kv serve --http`` server (FORMAT.md 7): ``http(s)://HOST:PORT/ID``.

- Sink (``coli-kv export``): the bundle streamed as the body of ``PUT /v1/sessions/ID/bundle``,
  in :mod:`sessionstore.migration.http_upload`.
- Source (``coli-kv import``): the body of ``GET /v1/sessions/ID/bundle`` read as a file by the
  normal verified import (nothing is installed unless the whole bundle verifies).

This module holds what both directions share (the URL, the client's options, the server's replies
read as errors) and the source. Every failure is one :class:`~kernels.errors.ColiError` naming the
URL: the server's own error (status, code, message) or what happened on the wire. httpx is imported
only here and in http_upload, on use.
"""
from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, cast
from urllib.parse import quote, urlsplit

from kernels.errors import (
    ColiError,
    CorruptionError,
    FormatError,
    LimitError,
    LockedError,
    ModelMismatchError,
    NotFoundError,
)
from sessionstore.log import get_logger
from sessionstore.sessions import validate_session_id

if TYPE_CHECKING:
    import httpx

log = get_logger("transport")

HTTP_SCHEMES = ("http", "https")
CONNECT_TIMEOUT_S = 10.0
TRANSFER_TIMEOUT_S = 600.0  # the longest silence tolerated (the server verifies a whole upload)
MAX_REPLY_BYTES = 1 << 20  # a JSON reply (session or error) read at most this long


class HttpTransferError(ColiError):
    """The server could not be reached, refused the key, failed, or the connection was cut."""

    exit_code = 1


def is_http(target: str) -> bool:
    return target.split(":", 1)[0].lower() in HTTP_SCHEMES and "://" in target


@dataclass(frozen=True)
class HttpOptions:
    """How to talk to the server: the bearer key and the longest silence tolerated. Proxies and CA
    files come from the usual environment (``HTTPS_PROXY``, ``NO_PROXY``, ``SSL_CERT_FILE``), as
    httpx reads them; certificates are verified."""

    api_key: str | None = None
    timeout_s: float = TRANSFER_TIMEOUT_S

    def client(self) -> httpx.Client:
        try:
            import httpx
        except ImportError:
            raise ColiError("http(s):// transfers need httpx (pip install 'coli-sessionstore[http]')") from None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = httpx.Timeout(self.timeout_s, connect=CONNECT_TIMEOUT_S)
        return httpx.Client(headers=headers, timeout=timeout, follow_redirects=False)


@dataclass(frozen=True)
class BundleUrl:
    """``http(s)://HOST:PORT`` + a session id: the server's address and the session's API paths."""

    base: str
    session_id: str

    @classmethod
    def parse(cls, url: str) -> BundleUrl:
        """``http(s)://HOST:PORT/ID`` (or ``.../v1/sessions/ID[/bundle]``); refused in one line otherwise."""
        parts = urlsplit(url)
        if parts.scheme.lower() not in HTTP_SCHEMES or not parts.hostname:
            raise FormatError(f"{url}: expected http(s)://HOST:PORT/SESSION_ID")
        if parts.username is not None or parts.password is not None:
            raise FormatError(f"{url}: no credentials in the URL; give --api-key (or set the key's "
                              "environment variable)")
        if parts.query or parts.fragment:
            raise FormatError(f"{url}: no query or fragment allowed; expected http(s)://HOST:PORT/SESSION_ID")
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number in range
        except ValueError as exc:
            raise FormatError(f"{url}: {exc}") from None
        segments = [s for s in parts.path.split("/") if s]
        if len(segments) in (3, 4) and segments[:2] == ["v1", "sessions"] and segments[3:] in ([], ["bundle"]):
            segments = segments[2:3]
        if len(segments) != 1:
            raise FormatError(f"{url}: name one session: http(s)://HOST:PORT/SESSION_ID")
        try:
            validate_session_id(segments[0])
        except ColiError as exc:
            raise FormatError(f"{url}: {exc}") from None
        return cls(f"{parts.scheme.lower()}://{parts.netloc}", segments[0])

    @property
    def session_url(self) -> str:
        return f"{self.base}/v1/sessions/{quote(self.session_id)}"

    @property
    def bundle_url(self) -> str:
        return self.session_url + "/bundle"


def with_session(url: str, session_id: str) -> str:
    """``http(s)://HOST:PORT`` (no path) names the server: the session keeps its id there."""
    parts = urlsplit(url)
    return url.rstrip("/") + "/" + session_id if parts.path in ("", "/") and not parts.query else url


# --- errors ----------------------------------------------------------------------------------
def one_line(text: str) -> str:
    return " ".join(text.split())


def server_error(where: str, status: int, body: bytes) -> ColiError:
    """The server's refusal as our error: its status, code and message (FORMAT.md 7 errors)."""
    code, message = "", ""
    try:
        err = json.loads(body).get("error", {})
        code, message = str(err.get("code") or ""), str(err.get("message") or "")
    except (ValueError, AttributeError):
        message = body[:200].decode("utf-8", "replace")
    said = f"HTTP {status}" + (f" {code}" if code else "") + (f": {one_line(message)}" if message else "")
    if status == 401:
        return HttpTransferError(f"{where}: {said} (give the server's key with --api-key)")
    if status == 404:
        return NotFoundError(f"{where}: {said}")
    if status == 409:
        if code == "model_mismatch":
            return ModelMismatchError(f"{where}: {said}")
        return LockedError(f"{where}: {said}") if code != "session_exists" else FormatError(f"{where}: {said}")
    if status == 413:
        return LimitError(f"{where}: {said}")
    if status == 400 and code == "bundle_invalid":
        return CorruptionError(f"{where}: {said}")
    if 400 <= status < 500:
        return FormatError(f"{where}: {said}")
    return HttpTransferError(f"{where}: {said}")


def wire_error(where: str, exc: BaseException, moved: int | None = None, verb: str = "sent",
                outcome: str = "") -> HttpTransferError:
    """What happened on the wire (httpx's transport errors), in one line."""
    import httpx

    detail = one_line(str(exc)) or type(exc).__name__
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return HttpTransferError(f"{where}: cannot reach the server ({detail})")
    if isinstance(exc, httpx.TimeoutException):
        return HttpTransferError(f"{where}: the server was silent for too long ({type(exc).__name__}: {detail})")
    if moved is not None:
        return HttpTransferError(f"{where}: the connection was cut after {moved} bytes of the bundle were "
                                 f"{verb} ({detail}){outcome}")
    return HttpTransferError(f"{where}: the connection failed ({type(exc).__name__}: {detail})")


def read_reply(response: httpx.Response) -> bytes:
    """A small reply body, bounded (a reply over MAX_REPLY_BYTES is cut there)."""
    got = bytearray()
    for piece in response.iter_bytes():
        got += piece
        if len(got) > MAX_REPLY_BYTES:
            break
    return bytes(got[:MAX_REPLY_BYTES])


# --- source: GET /v1/sessions/ID/bundle ------------------------------------------------------
class DownloadSource(io.RawIOBase):
    """A readable file over a streamed response body; a cut connection is one clear error."""

    def __init__(self, response: httpx.Response, where: str) -> None:
        super().__init__()
        self.where = where
        self.pieces = response.iter_bytes()  # content-encoding undone, if a proxy added one
        self.left = memoryview(b"")
        self.received = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        import httpx

        while not self.left:
            try:
                piece = next(self.pieces)
            except StopIteration:
                return 0
            except httpx.HTTPError as exc:
                raise wire_error(self.where, exc, self.received, "received", "; nothing was installed") from None
            self.left = memoryview(piece)
        view = memoryview(b).cast("B")
        n = min(len(view), len(self.left))
        view[:n] = self.left[:n]
        self.left = self.left[n:]
        self.received += n
        return n


@contextmanager
def http_source(url: str, options: HttpOptions) -> Iterator[BinaryIO]:
    """The bundle of the session ``url`` names, streamed front to back."""
    target = BundleUrl.parse(url)
    client = options.client()  # a missing httpx is one line here
    import httpx

    try:
        try:
            response = client.send(client.build_request("GET", target.bundle_url), stream=True)
        except httpx.HTTPError as exc:
            raise wire_error(target.bundle_url, exc) from None
        try:
            if response.status_code != 200:
                try:
                    body = read_reply(response)
                except httpx.HTTPError:
                    body = b""
                raise server_error(target.bundle_url, response.status_code, body)
            source = DownloadSource(response, target.bundle_url)
            yield cast(BinaryIO, source)
            log.info("transport.http_get", url=target.bundle_url, bytes=source.received)
        finally:
            response.close()
    finally:
        client.close()


__all__ = ["BundleUrl", "HttpOptions", "HttpTransferError", "http_source", "is_http", "read_reply", "server_error",
           "wire_error", "with_session"]
