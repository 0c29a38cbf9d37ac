"""Bundles to a ``coli-kv serve --http`` server (FORMAT.md 7): the sink of ``coli-kv export`` to
``http(s)://HOST:PORT/ID``.

The bundle is streamed as the body of ``PUT /v1/sessions/ID/bundle`` (chunked, from a bounded
queue: neither the whole bundle nor a spool file exists on this host). A ``GET /v1/sessions/ID``
first refuses early what the server would refuse after the transfer (an unreachable server, a
wrong key, a session there without ``replace``, a resident one). An export that fails mid-stream
cuts the connection before the body's end: the server discards its spool and installs nothing.
The URL, the client and the server's replies read as errors are :mod:`~sessionstore.migration.http_transport`'s.
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

from kernels.errors import FormatError, LockedError
from sessionstore.log import get_logger
from sessionstore.migration.http_transport import (
    CONNECT_TIMEOUT_S,
    BundleUrl,
    HttpOptions,
    HttpTransferError,
    read_reply,
    server_error,
    wire_error,
)

if TYPE_CHECKING:
    import httpx

log = get_logger("transport")

SEND_BYTES = 1 << 20  # small frame writes are joined into pieces of about this size
QUEUE_PIECES = 4  # pieces in flight between the exporter and the upload (bounded memory)
_END = b""


def _session_state(client: httpx.Client, target: BundleUrl) -> dict[str, Any] | None:
    """The server's description of the session, or None where it has none."""
    import httpx

    try:
        with client.stream("GET", target.session_url) as response:
            body = read_reply(response)
    except httpx.HTTPError as exc:
        raise wire_error(target.session_url, exc) from None
    if response.status_code == 404:
        return None
    if response.status_code != 200:
        raise server_error(target.session_url, response.status_code, body)
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
                self.status, self.body = response.status_code, read_reply(response)
        except _Aborted:
            pass
        except httpx.HTTPError as exc:
            outcome = (f"; the server's verdict is unknown: see GET {self.target.session_url}" if self.sent_all
                       else "; the server installs nothing")
            self.failure = wire_error(self.target.bundle_url, exc, self.sent, "sent", outcome)
        except BaseException as exc:  # handed to the exporter's thread, which raises it
            self.failure = exc
        finally:
            self.done.set()

    def _outcome_error(self) -> BaseException | None:
        if self.failure is not None:
            return self.failure
        if self.status and self.status != 200:
            return server_error(self.target.bundle_url, self.status, self.body)
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


__all__ = ["UploadOutcome", "UploadSink", "http_sink"]
