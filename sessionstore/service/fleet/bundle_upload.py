"""Bundles over HTTP, the upload side: ``PUT /v1/sessions/{id}/bundle`` imports the request body
AS IT STREAMS (no spool file): a thread reads it through :class:`BodyPipe` into the new session's
temp directory under ``<root>/tmp/`` (``migration.receive_bundle``: every chunk verified before it
is written, then the file digests, trailer, header, sidecar, fsync), while the event loop feeds the
pipe and counts the bytes against ``max_bundle_bytes``. Only a bundle that verified whole is
installed, by one rename under the session's claim (refused while the session is resident): the
engine core's ``install`` operation (:func:`sessionstore.service.engine.operations.op_install`).

A body over the limit is refused with 413 as soon as the limit is passed; a cut upload (the
client vanished) or one the receiver refused leaves no session and no temp directory: the
receiver removes its directory before the handler answers. After a refusal by the receiver the
rest of the body is read and discarded (still counted against the limit), so that the client
gets the answer instead of a reset connection.
"""
from __future__ import annotations

import asyncio
import io
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol, TypeVar, cast

import msgspec

from kernels.errors import CorruptionError
from sessionstore.log import get_logger
from sessionstore.migration import ReceivedBundle, receive_bundle
from sessionstore.service.errors import ApiError
from sessionstore.sessions import SessionStore

log = get_logger("service")

PIPE_HIGH_WATER = 8 << 20  # bytes buffered between the event loop and the receiving thread
T = TypeVar("T")


class BodyPipe(io.RawIOBase):
    """A request body as a readable binary file for ONE reading thread, fed by the event loop.

    ``feed`` (event loop) waits while :data:`PIPE_HIGH_WATER` bytes are buffered (backpressure on
    the client); ``readinto`` (thread) blocks until bytes, the end or an error arrive. ``end``
    closes the body (``error``: what ``readinto`` raises instead of returning the end);
    ``abandon`` (the reader gave up) makes later ``feed`` calls drop their data.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, high_water: int = PIPE_HIGH_WATER) -> None:
        super().__init__()
        self._loop, self._high = loop, high_water
        self._cond = threading.Condition()
        self._parts: deque[memoryview] = deque()
        self._buffered = 0
        self._ended = False
        self._error: BaseException | None = None
        self._abandoned = False
        self._feeder_waits = False
        self._room = asyncio.Event()
        self.received = 0  # bytes fed so far


    @property
    def buffered(self) -> int:
        """Bytes fed and not yet read: what the high-water mark bounds (the feeder waits above it)."""
        return self._buffered
    def readable(self) -> bool:
        return True

    async def feed(self, data: bytes) -> None:
        self.received += len(data)
        while True:
            with self._cond:
                if self._abandoned:
                    return
                if self._buffered < self._high:
                    self._parts.append(memoryview(data))
                    self._buffered += len(data)
                    self._cond.notify()
                    return
                self._feeder_waits = True
                self._room.clear()
            await self._room.wait()

    def end(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._ended, self._error = True, error
            self._cond.notify()

    def abandon(self) -> None:
        with self._cond:
            self._abandoned = True
            self._parts.clear()
            self._buffered = 0
            self._wake_feeder()

    def _wake_feeder(self) -> None:  # holding the lock
        if self._feeder_waits:
            self._feeder_waits = False
            self._loop.call_soon_threadsafe(self._room.set)

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        with self._cond:
            while not self._parts and not self._ended:
                self._cond.wait()
            if not self._parts:
                if self._error is not None:
                    raise self._error
                return 0
            got = 0
            while self._parts and got < len(out):
                part = self._parts[0]
                take = min(len(part), len(out) - got)
                out[got:got + take] = part[:take]
                got += take
                if take == len(part):
                    self._parts.popleft()
                else:
                    self._parts[0] = part[take:]
            self._buffered -= got
            if self._buffered < self._high:
                self._wake_feeder()
            return got


def in_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """Run ``fn`` in a thread of its own (not the shared executor: a slow upload holds it)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if fut.cancelled():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(cast(T, result))

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # delivered to the awaiting handler
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="coli-upload", daemon=True).start()
    return fut


class CoreCalls(Protocol):
    """What a bundle's receiver asks of the engine core: one of its named operations
    (:data:`sessionstore.service.engine.operations.OPERATIONS`), by the API process's
    :class:`~sessionstore.service.http.core_client.CoreClient`."""

    async def call(self, op: str, **args: Any) -> Any: ...


@dataclass(frozen=True)
class BundleHost:
    """Where a bundle is received (the store's tmp/, for ``model_source``'s sessions) and the core
    that checks the target and installs it."""

    store: SessionStore
    model_source: str
    core: CoreCalls

    async def check_target(self, session_id: str, replace: bool) -> None:
        """Refuse an upload over a taken id without ``replace`` (409 session_exists) or over a
        resident session (409 session_live), before the body is read (the install checks again)."""
        await self.core.call("check_target", sid=session_id, replace=replace)

    async def install(self, session_id: str, received: ReceivedBundle, replace: bool) -> dict[str, Any]:
        """Install a verified bundle under the session's claim, in the core; discarded if refused."""
        try:
            result: dict[str, Any] = await self.core.call(
                "install", sid=session_id, tmp=str(received.tmp), bundle_id=received.session_id,
                source_name=received.source_name, stats=msgspec.to_builtins(received.stats), start=received.start,
                replace=replace)
        except BaseException:
            received.discard()
            raise
        return result


def too_large(limit: int, declared: str | None = None) -> ApiError:
    what = f"the bundle of {declared} bytes" if declared else "the bundle"
    return ApiError(413, f"{what} exceeds the limit of {limit} bytes", code="body_too_large")


async def receive_upload(host: BundleHost, session_id: str, body: AsyncIterator[bytes], *,
                         limit: int) -> ReceivedBundle:
    """Stream ``body`` into a verified temp directory (nothing installed); ApiError on refusal."""
    pipe = BodyPipe(asyncio.get_running_loop())

    def receive() -> ReceivedBundle:
        try:
            return receive_bundle(host.store, cast(BinaryIO, pipe), source_name="upload", replace=True,
                                  model=host.model_source, as_id=session_id)
        finally:
            pipe.abandon()  # whatever the outcome, the loop stops handing it bytes

    receiver = in_thread(receive)
    refused: ApiError | None = None
    clock = time.perf_counter
    start, pieces, fed_s, loop_cpu = clock(), 0, 0.0, time.thread_time()
    try:
        async for chunk in body:
            if pipe.received + len(chunk) > limit:
                refused = too_large(limit)
                break
            t = clock()
            await pipe.feed(chunk)
            fed_s += clock() - t
            pieces += 1
    except BaseException as exc:  # the client went away: a cut upload
        pipe.end(CorruptionError(f"upload: the request body was cut after {pipe.received} bytes "
                                 f"({type(exc).__name__})"))
        await asyncio.gather(receiver, return_exceptions=True)  # its temp directory is gone
        raise
    pipe.end(CorruptionError(f"upload: the body of {pipe.received} bytes was refused") if refused else None)
    body_s = clock() - start
    try:
        received = await receiver
    except CorruptionError as exc:  # the upload's fault, not the store's
        raise refused or ApiError(400, f"the uploaded bundle failed verification: {exc}",
                                  code="bundle_invalid") from None
    except BaseException:
        if refused is not None:
            raise refused from None
        raise
    if refused is not None:  # pragma: no cover - the receiver cannot finish a body it never got whole
        received.discard()
        raise refused
    log.debug("bundle.upload_spans", id=session_id, bytes=pipe.received, pieces=pieces, body_s=round(body_s, 4),
              feed_wait_s=round(fed_s, 4), receive_s=round(clock() - start, 4),
              loop_cpu_s=round(time.thread_time() - loop_cpu, 4))
    return received


async def put_bundle(host: BundleHost, session_id: str, body: AsyncIterator[bytes], *, limit: int,
                     declared: str | None, replace: bool) -> dict[str, Any]:
    """The whole PUT: refusals before the body, the streamed receive, the install; its result."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit, declared)
    await host.check_target(session_id, replace)
    received = await receive_upload(host, session_id, body, limit=limit)
    return await host.install(session_id, received, replace)


__all__ = ["BodyPipe", "BundleHost", "CoreCalls", "PIPE_HIGH_WATER", "in_thread", "put_bundle", "receive_upload"]
