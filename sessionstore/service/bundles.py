"""Bundles over HTTP, the export side: ``GET /v1/sessions/{id}/bundle`` streams an export of the
session's last commit (FORMAT.md 6, written by ``migration.PreparedExport`` in a thread of its own,
no decoder needed). The upload side (``PUT``) is :mod:`sessionstore.service.bundle_upload`.

Compression (``?compress=auto|none|1..22``): without the parameter a client on a loopback address
gets ``none`` (a zstd pass costs more than the loopback link it would save) and every other client
``auto`` (the writer's measured per-chunk choice). With ``none`` the response carries the bundle's
exact ``Content-Length``, so a body cut short by a failing export is an HTTP-level error as well as
a bundle without its trailer.
"""
from __future__ import annotations

import asyncio
import io
import ipaddress
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any, BinaryIO, cast

from sessionstore.migration.exporting import PreparedExport
from sessionstore.service.engine import Engine
from sessionstore.service.errors import ApiError

QUEUE_CHUNKS = 8  # writes buffered between the exporting thread and a slow client
JOIN_BYTES = 64 << 10  # writes below this wait to go out with the next one
END = b""
MAX_ZSTD_LEVEL = 22


class _Gone(Exception):
    """The client stopped reading: the export is abandoned."""


class QueueSink(io.RawIOBase):
    """A writable file whose bytes go to a bounded queue (backpressure on the writer).

    Writes smaller than :data:`JOIN_BYTES` (a chunk's 24-byte header, the frames) wait and go
    out joined with the next large one, so each queue item (one response body message, one
    socket write) is a chunk's header and payload together; ``flush`` sends what waits. Either
    way each byte is copied once (the writer's views of the mapping may not outlive the call).
    """

    def __init__(self, out: queue.Queue[bytes | BaseException], gone: threading.Event) -> None:
        super().__init__()
        self.out, self.gone = out, gone
        self._waiting: list[bytes] = []
        self._waiting_bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = len(memoryview(b).cast("B"))
        if self._waiting_bytes + n < JOIN_BYTES:
            self._waiting.append(bytes(b))
            self._waiting_bytes += n
            return n
        data = b"".join([*self._waiting, b]) if self._waiting else bytes(b)
        self._waiting.clear()
        self._waiting_bytes = 0
        self._put(data)
        return n

    def flush(self) -> None:
        if self._waiting:
            data = b"".join(self._waiting)
            self._waiting.clear()
            self._waiting_bytes = 0
            self._put(data)

    def _put(self, data: bytes) -> None:
        while True:
            if self.gone.is_set():
                raise _Gone()
            try:
                self.out.put(data, timeout=0.5)  # wakes to notice a vanished client
                return
            except queue.Full:
                continue


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a peer's address) is a loopback address (IPv4-mapped IPv6 included)."""
    if not host:
        return False
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def export_compression(asked: str | None, peer: str | None) -> str | int:
    """The compression of a GET's bundle: ``asked`` (``?compress=``), else ``none`` for a loopback
    peer and ``auto`` for any other."""
    if asked is None:
        return "none" if is_loopback(peer) else "auto"
    if asked in ("auto", "none"):
        return asked
    if asked.isdigit() and 1 <= int(asked) <= MAX_ZSTD_LEVEL:
        return int(asked)
    raise ApiError(400, f"compress={asked!r}: expected auto, none or a zstd level 1..{MAX_ZSTD_LEVEL}",
                   param="compress", code="invalid_value")


async def export_stream(engine: Engine, session_id: str, compression: str | int = "auto"
                        ) -> tuple[AsyncIterator[bytes], dict[str, str]]:
    """The bundle's bytes as they are written, and the response's headers (the exact
    ``content-length`` when nothing is compressed). The export is opened before the response
    starts (a missing or unreadable session is an error status); an export error later ends the
    body early (the bundle's own framing lets the receiver detect a truncated one)."""
    export = await asyncio.to_thread(PreparedExport, engine.store, session_id)
    headers = {"content-disposition": f'attachment; filename="{session_id}.colibundle"',
               "x-coli-bundle-compression": str(compression)}
    if compression == "none":
        headers["content-length"] = str(export.raw_bundle_bytes())
    chunks: queue.Queue[bytes | BaseException] = queue.Queue(maxsize=QUEUE_CHUNKS)
    gone = threading.Event()

    def run() -> None:
        try:
            export.write(cast(BinaryIO, QueueSink(chunks, gone)), compression=compression)
            chunks.put(END)
        except _Gone:
            return
        except BaseException as exc:  # handed to the response, which ends early
            chunks.put(exc)
        finally:
            export.close()

    thread = threading.Thread(target=run, name="coli-export", daemon=True)
    thread.start()

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                try:
                    item = chunks.get_nowait()  # the export is usually ahead of the socket
                except queue.Empty:
                    item = await asyncio.to_thread(chunks.get)
                if isinstance(item, BaseException) or item == END:
                    return
                yield item
        finally:
            gone.set()

    return body(), headers


__all__ = ["QueueSink", "export_compression", "export_stream", "is_loopback"]
