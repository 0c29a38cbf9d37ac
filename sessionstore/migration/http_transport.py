"""Bundles to and from a ``coli-kv serve --http`` server (FORMAT.md 7): ``http(s)://HOST:PORT/ID``.

- Sink (``coli-kv export``): the bundle is streamed as the body of ``PUT /v1/sessions/ID/bundle``
  (chunked, from a bounded queue: neither the whole bundle nor a spool file exists on this host).
  A ``GET /v1/sessions/ID`` first refuses early what the server would refuse after the transfer
  (an unreachable server, a wrong key, a session there without ``replace``, a resident one). An
  export that fails mid-stream cuts the connection before the body's end: the server discards
  its spool and installs nothing.
- Source (``coli-kv import``): the body of ``GET /v1/sessions/ID/bundle`` read as a file by the
  normal verified import (nothing is installed unless the whole bundle verifies).

Every failure is one :class:`~kernels.errors.ColiError` naming the URL: the server's own error
(status, code, message) or what happened on the wire. httpx is imported only here, on use.
"""
from __future__ import annotations

import io
import json
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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
SEND_BYTES = 1 << 20  # small frame writes are joined into pieces of about this size
QUEUE_PIECES = 4  # pieces in flight between the exporter and the upload (bounded memory)
MAX_REPLY_BYTES = 1 << 20  # a JSON reply (session or error) read at most this long
_END = b""


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
def _one_line(text: str) -> str:
    return " ".join(text.split())


def _server_error(where: str, status: int, body: bytes) -> ColiError:
    """The server's refusal as our error: its status, code and message (FORMAT.md 7 errors)."""
    code, message = "", ""
    try:
        err = json.loads(body).get("error", {})
        code, message = str(err.get("code") or ""), str(err.get("message") or "")
    except (ValueError, AttributeError):
        message = body[:200].decode("utf-8", "replace")
    said = f"HTTP {status}" + (f" {code}" if code else "") + (f": {_one_line(message)}" if message else "")
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


def _wire_error(where: str, exc: BaseException, moved: int | None = None, verb: str = "sent",
                outcome: str = "") -> HttpTransferError:
    """What happened on the wire (httpx's transport errors), in one line."""
    import httpx

    detail = _one_line(str(exc)) or type(exc).__name__
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return HttpTransferError(f"{where}: cannot reach the server ({detail})")
    if isinstance(exc, httpx.TimeoutException):
        return HttpTransferError(f"{where}: the server was silent for too long ({type(exc).__name__}: {detail})")
    if moved is not None:
        return HttpTransferError(f"{where}: the connection was cut after {moved} bytes of the bundle were "
                                 f"{verb} ({detail}){outcome}")
    return HttpTransferError(f"{where}: the connection failed ({type(exc).__name__}: {detail})")


def _read_reply(response: httpx.Response) -> bytes:
    """A small reply body, bounded (a reply over MAX_REPLY_BYTES is cut there)."""
    got = bytearray()
    for piece in response.iter_bytes():
        got += piece
        if len(got) > MAX_REPLY_BYTES:
            break
    return bytes(got[:MAX_REPLY_BYTES])


def _session_state(client: httpx.Client, target: BundleUrl) -> dict[str, Any] | None:
    """The server's description of the session, or None where it has none."""
    import httpx

    try:
        with client.stream("GET", target.session_url) as response:
            body = _read_reply(response)
    except httpx.HTTPError as exc:
        raise _wire_error(target.session_url, exc) from None
    if response.status_code == 404:
        return None
    if response.status_code != 200:
        raise _server_error(target.session_url, response.status_code, body)
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise HttpTransferError(f"{target.session_url}: the reply is not a session object (not a coli-kv server?)")
    return doc


# --- sink: PUT /v1/sessions/ID/bundle --------------------------------------------------------
class _Aborted(Exception):
    """Raised inside the request body: the connection is cut before the body's end."""


@dataclass
class UploadOutcome:
    """Where the bundle went, and the server's answer once it installed it."""

    url: str
    reply: dict[str, Any] = field(default_factory=dict)  # the session (FORMAT.md 7) + "imported"


class UploadSink(io.RawIOBase):
    """A writable file whose bytes become the body of one PUT, sent by a thread of its own.

    Writes are joined into pieces of about SEND_BYTES and handed over through a bounded queue
    (backpressure on the exporter); a piece is a copy, so the exporter's mapped views may go."""

    def __init__(self, client: httpx.Client, target: BundleUrl, replace: bool) -> None:
        super().__init__()
        self.client, self.target, self.replace = client, target, replace
        self.pieces: queue.Queue[bytes | BaseException] = queue.Queue(maxsize=QUEUE_PIECES)
        self.buffer = bytearray()
        self.sent = 0  # body bytes handed to the connection
        self.sent_all = False  # the body's end was handed over too
        self.done = threading.Event()
        self.status = 0
        self.body = b""
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="coli-upload", daemon=True)
        self.thread.start()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = len(memoryview(b).cast("B"))
        if len(self.buffer) + n < SEND_BYTES:
            self.buffer += b
            return n
        if self.buffer:
            self.buffer += b
            piece, self.buffer = bytes(self.buffer), bytearray()
        else:
            piece = bytes(b)
        self._hand_over(piece)
        return n

    def flush(self) -> None:
        if self.buffer:
            piece, self.buffer = bytes(self.buffer), bytearray()
            self._hand_over(piece)

    def _hand_over(self, item: bytes | BaseException) -> None:
        while not self.done.is_set():
            try:
                self.pieces.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise self._outcome_error() or HttpTransferError(
            f"{self.target.bundle_url}: the upload ended before the bundle was sent")

    def _body(self) -> Iterator[bytes]:
        while True:
            item = self.pieces.get()
            if isinstance(item, BaseException):
                raise item
            if item == _END:
                self.sent_all = True
                return
            self.sent += len(item)
            yield item

    def _run(self) -> None:
        import httpx

        params = {"replace": "1" if self.replace else "0"}
        try:
            with self.client.stream("PUT", self.target.bundle_url, params=params, content=self._body(),
                                    headers={"content-type": "application/octet-stream"}) as response:
                self.status, self.body = response.status_code, _read_reply(response)
        except _Aborted:
            pass
        except httpx.HTTPError as exc:
            outcome = (f"; the server's verdict is unknown: see GET {self.target.session_url}" if self.sent_all
                       else "; the server installs nothing")
            self.failure = _wire_error(self.target.bundle_url, exc, self.sent, "sent", outcome)
        except BaseException as exc:  # handed to the exporter's thread, which raises it
            self.failure = exc
        finally:
            self.done.set()

    def _outcome_error(self) -> BaseException | None:
        if self.failure is not None:
            return self.failure
        if self.status and self.status != 200:
            return _server_error(self.target.bundle_url, self.status, self.body)
        return None

    def finish(self) -> dict[str, Any]:
        """End the body, wait for the server's verdict; the installed session's description."""
        self.flush()
        self._hand_over(_END)
        self.thread.join()
        error = self._outcome_error()
        if error is not None:
            raise error
        try:
            reply = json.loads(self.body)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise HttpTransferError(f"{self.target.bundle_url}: HTTP 200 without a session object")
        return reply

    def abort(self) -> None:
        """Cut the connection before the body's end: the server installs nothing."""
        while True:  # pieces nobody will send: room for the abort at once
            try:
                self.pieces.get_nowait()
            except queue.Empty:
                break
        try:
            self._hand_over(_Aborted())
        except BaseException:  # the upload had already ended
            pass
        self.thread.join(timeout=CONNECT_TIMEOUT_S)


@contextmanager
def http_sink(url: str, options: HttpOptions, *, replace: bool = False
              ) -> Iterator[tuple[BinaryIO, UploadOutcome]]:
    """A sink whose bundle the server at ``url`` verifies and installs when the block exits
    normally; on error the upload is cut and nothing is installed."""
    target = BundleUrl.parse(url)
    client = options.client()
    try:
        state = _session_state(client, target)
        if state is not None and not replace:
            raise FormatError(f"{target.bundle_url}: the server already has session {target.session_id!r}; "
                              "give --replace to swap it for this one")
        if state is not None and state.get("state") == "resident":
            raise LockedError(f"{target.bundle_url}: session {target.session_id!r} is resident on the server; "
                              f"suspend it there first (POST {target.session_url}/suspend)")
        sink = UploadSink(client, target, replace)
        outcome = UploadOutcome(target.bundle_url)
        try:
            yield cast(BinaryIO, sink), outcome
            outcome.reply.update(sink.finish())
        except BaseException:
            sink.abort()
            raise
        log.info("transport.http_put", url=target.bundle_url, bytes=sink.sent)
    finally:
        client.close()


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
                raise _wire_error(self.where, exc, self.received, "received", "; nothing was installed") from None
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
            raise _wire_error(target.bundle_url, exc) from None
        try:
            if response.status_code != 200:
                try:
                    body = _read_reply(response)
                except httpx.HTTPError:
                    body = b""
                raise _server_error(target.bundle_url, response.status_code, body)
            source = DownloadSource(response, target.bundle_url)
            yield cast(BinaryIO, source)
            log.info("transport.http_get", url=target.bundle_url, bytes=source.received)
        finally:
            response.close()
    finally:
        client.close()


__all__ = ["BundleUrl", "HttpOptions", "HttpTransferError", "http_sink", "http_source",
           "is_http", "with_session"]
