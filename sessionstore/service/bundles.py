"""Bundles over HTTP: ``GET /v1/sessions/{id}/bundle`` streams an export of the session's last
commit (FORMAT.md 6, written by ``migration.export_session`` in a thread of its own, no decoder
needed); ``PUT`` receives one into the store's ``tmp/`` (bounded by ``max_bundle_bytes``) and
imports it with ``migration.import_bundle`` (verified before install; refused while the session is
resident or busy)."""
from __future__ import annotations

import asyncio
import io
import queue
import shutil
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO, cast

from kernels.errors import CorruptionError
from sessionstore.migration import export_session, import_bundle
from sessionstore.service.engine import Engine
from sessionstore.service.errors import ApiError

QUEUE_CHUNKS = 8  # chunks buffered between the exporting thread and a slow client
END = b""


class _Gone(Exception):
    """The client stopped reading: the export is abandoned."""


class QueueSink(io.RawIOBase):
    """A writable file whose bytes go to a bounded queue (backpressure on the writer)."""

    def __init__(self, out: queue.Queue[bytes | BaseException], gone: threading.Event) -> None:
        super().__init__()
        self.out, self.gone = out, gone

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        while data:
            if self.gone.is_set():
                raise _Gone()
            try:
                self.out.put(data, timeout=0.5)  # wakes to notice a vanished client
                break
            except queue.Full:
                continue
        return len(b)


async def export_stream(engine: Engine, session_id: str) -> AsyncIterator[bytes]:
    """The bundle's bytes as they are written; an export error ends the body early (the
    bundle's own framing lets the receiver detect a truncated one)."""
    engine.store.snapshot(session_id)  # 404 before the response starts
    chunks: queue.Queue[bytes | BaseException] = queue.Queue(maxsize=QUEUE_CHUNKS)
    gone = threading.Event()

    def run() -> None:
        try:
            export_session(engine.store, session_id, cast(BinaryIO, QueueSink(chunks, gone)))
            chunks.put(END)
        except _Gone:
            return
        except BaseException as exc:  # handed to the response, which ends early
            chunks.put(exc)

    thread = threading.Thread(target=run, name="coli-export", daemon=True)
    thread.start()

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                item = await asyncio.to_thread(chunks.get)
                if isinstance(item, BaseException) or item == END:
                    return
                yield item
        finally:
            gone.set()

    return body()


def spool_path(engine: Engine) -> Path:
    return engine.store.tmp_dir() / "upload.colibundle"


def import_spooled(engine: Engine, session_id: str, path: Path, replace: bool = True) -> dict[str, Any]:
    """Import the uploaded bundle as ``session_id`` (the baton's holder; the session is claimed);
    without ``replace`` a session of that id is refused (409 session_exists)."""
    try:
        if not replace and engine.store.exists(session_id):
            raise ApiError(409, f"session {session_id!r} already exists here (replace=0)", code="session_exists")
        if engine.state_of(session_id) == "resident":
            raise ApiError(409, f"session {session_id!r} is resident here; suspend it before replacing it",
                           code="session_live")
        engine.forget(session_id)
        with open(path, "rb") as source:
            try:
                result = import_bundle(engine.store, source, source_name="upload", replace=True,
                                       model=engine.model_source, as_id=session_id)
            except CorruptionError as exc:  # the upload's fault, not the store's
                raise ApiError(400, f"the uploaded bundle failed verification: {exc}", code="bundle_invalid") from None
        return result.to_json()
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


__all__ = ["QueueSink", "export_stream", "import_spooled", "spool_path"]
