"""Bundles over HTTP, the export side: ``GET /v1/sessions/{id}/bundle`` streams an export of the
session's last commit (FORMAT.md 6, written by ``migration.PreparedExport`` in a thread of its own,
no decoder needed). The upload side (``PUT``) is :mod:`sessionstore.service.fleet.bundle_upload`.

Compression (``?compress=auto|none|1..22``): without the parameter a client on a loopback address
gets ``none`` (a zstd pass costs more than the loopback link it would save) and every other client
``auto`` (the writer's measured per-chunk choice). With ``none`` the response carries the bundle's
exact ``Content-Length``, so a body cut short by a failing export is an HTTP-level error as well as
a bundle without its trailer.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import weakref
from collections.abc import AsyncIterator
from typing import Any, BinaryIO, cast

from sessionstore.migration import PreparedExport
from sessionstore.service.bind import is_loopback_address
from sessionstore.service.errors import ApiError
from sessionstore.service.fleet.loop_outbox import outbox_of
from sessionstore.sessions import SessionStore

QUEUE_CHUNKS = 8  # writes buffered between the exporting thread and a slow client
GONE_POLL_S = 0.5  # how soon an export waiting for room notices that its client left
JOIN_BYTES = 64 << 10  # writes below this wait to go out with the next one
END = b""
MAX_ZSTD_LEVEL = 22


class ReaderGone(Exception):
    """The client stopped reading: the export is abandoned."""


class ChunkHandoff:
    """The exporting thread's writes to the response's coroutine on ``loop``: at most ``capacity``
    in flight (backpressure on the export), delivered through the loop's outbox, so no executor
    thread ever waits on a queue for an export that a vanished client abandoned. Once closed (the
    client gone, or the loop stopped), a ``put`` raises :class:`ReaderGone` within
    :data:`GONE_POLL_S`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int = QUEUE_CHUNKS) -> None:
        self._loop, self._outbox = loop, outbox_of(loop)
        self._items: asyncio.Queue[bytes | BaseException] = asyncio.Queue()
        self._room = threading.Semaphore(capacity)
        self._gone = threading.Event()

    def put(self, item: bytes | BaseException) -> None:
        """(the exporting thread) Hand ``item`` over, waiting while ``capacity`` items are unread."""
        while not self._room.acquire(timeout=GONE_POLL_S):
            if self._gone.is_set() or self._loop.is_closed():
                raise ReaderGone()
        if self._gone.is_set() or not self._outbox.put(self._items, item):
            raise ReaderGone()

    async def get(self) -> bytes | BaseException:
        """(the loop) The next item, in order."""
        item = await self._items.get()
        self._room.release()
        return item

    def close(self) -> None:
        """Nobody reads any more: a waiting ``put`` gives up now, later ones at once."""
        self._gone.set()
        self._room.release()


class QueueSink(io.RawIOBase):
    """A writable file whose bytes go to a :class:`ChunkHandoff` (backpressure on the writer).

    Writes smaller than :data:`JOIN_BYTES` (a chunk's 24-byte header, the frames) wait and go
    out joined with the next large one, so each item handed over (one response body message, one
    socket write) is a chunk's header and payload together; ``flush`` sends what waits. Either
    way each byte is copied once (the writer's views of the mapping may not outlive the call).
    """

    def __init__(self, out: ChunkHandoff) -> None:
        super().__init__()
        self.out = out
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
        self.out.put(data)
        return n

    def flush(self) -> None:
        if self._waiting:
            data = b"".join(self._waiting)
            self._waiting.clear()
            self._waiting_bytes = 0
            self.out.put(data)


def export_compression(asked: str | None, peer: str | None) -> str | int:
    """The compression of a GET's bundle: ``asked`` (``?compress=``), else ``none`` for a loopback
    peer and ``auto`` for any other."""
    if asked is None:
        return "none" if is_loopback_address(peer) else "auto"
    if asked in ("auto", "none"):
        return asked
    if asked.isdigit() and 1 <= int(asked) <= MAX_ZSTD_LEVEL:
        return int(asked)
    raise ApiError(400, f"compress={asked!r}: expected auto, none or a zstd level 1..{MAX_ZSTD_LEVEL}",
                   param="compress", code="invalid_value")


async def export_stream(store: SessionStore, session_id: str, compression: str | int = "auto"
                        ) -> tuple[AsyncIterator[bytes], dict[str, str]]:
    """The bundle's bytes as they are written, and the response's headers (the exact
    ``content-length`` when nothing is compressed). The export is opened before the response
    starts (a missing or unreadable session is an error status); an export error later ends the
    body early (the bundle's own framing lets the receiver detect a truncated one)."""
    export = await asyncio.to_thread(PreparedExport, store, session_id)
    headers = {"content-disposition": f'attachment; filename="{session_id}.colibundle"',
               "x-coli-bundle-compression": str(compression)}
    if compression == "none":
        headers["content-length"] = str(export.raw_bundle_bytes())
    handoff = ChunkHandoff(asyncio.get_running_loop())
    started = threading.Event()

    def run() -> None:
        try:
            export.write(cast(BinaryIO, QueueSink(handoff)), compression=compression)
            handoff.put(END)
        except ReaderGone:
            return
        except BaseException as exc:  # handed to the response, which ends early
            with contextlib.suppress(ReaderGone):
                handoff.put(exc)
        finally:
            export.close()

    async def body() -> AsyncIterator[bytes]:
        started.set()  # the export thread runs only for a response that reads its body
        threading.Thread(target=run, name="coli-export", daemon=True).start()
        try:
            while True:
                item = await handoff.get()
                if isinstance(item, BaseException) or item == END:
                    return
                yield item
        finally:
            handoff.close()

    def never_started() -> None:
        if not started.is_set():  # a response that failed before its body (the client left) still closes it
            export.close()

    stream = body()
    weakref.finalize(stream, never_started)
    return stream, headers


__all__ = ["ChunkHandoff", "QueueSink", "ReaderGone", "export_compression", "export_stream"]
