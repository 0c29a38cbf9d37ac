"""The API process's side of the engine core: it starts the core's process, sends it requests as
data, routes what comes back to the waiting handlers, and starts a new core when one dies.

Everything runs on the API process's event loop: one task receives the core's events (an asyncio
zmq socket), one watches the core's process. Sending never blocks (no high-water mark: a request
is queued until the core reads it). When the core dies, every running turn ends with an error
event (503 ``engine_restarted``) and every pending call with that error; until the new core says
it is ready, new work is refused with 503 ``engine_unavailable`` and ``/healthz`` says
``engine_restarting``. The new core opens the store as any restart does: each session resumes from
its last commit.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import select
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kernels.errors import ColiError
from sessionstore.log import get_logger
from sessionstore.service import wire
from sessionstore.service.errors import ApiError
from sessionstore.service.http.streams import Event

log = get_logger("service.client")

CORE_MODULE = "sessionstore.service.engine.process"  # run as ``python -m`` (a fault-injecting test launcher swaps it)
START_TIMEOUT_S = 600.0  # loading a big checkpoint can take minutes
STOP_TIMEOUT_S = 120.0  # the core commits and suspends every session before it exits
WATCH_S = 0.1  # how often the watcher looks at the core's process
RESTART_PAUSE_S = 1.0  # between failed starts of a new core


class HeldElsewhere(ApiError):
    """Another live host holds the session; ``holder_url``: where it serves (None: unknown)."""

    def __init__(self, message: str, holder_url: str | None) -> None:
        super().__init__(409, message, code="session_held")
        self.holder_url = holder_url


def error_of(info: wire.ErrorInfo) -> ApiError:
    if info.held:
        return HeldElsewhere(info.message, info.holder_url)
    return ApiError(info.status, info.message, param=info.param, code=info.code)


def unavailable() -> ApiError:
    return ApiError(503, "the engine is restarting after its process died; retry in a few seconds",
                    code="engine_unavailable")


class CoreStream:
    """One turn's events as the core sends them (:class:`Event` "text", then "done" or "error")."""

    def __init__(self, client: CoreClient, rid: int) -> None:
        self._client, self.rid = client, rid
        self._events: deque[Event] = deque()  # put, not yet taken (one reader: the turn's handler)
        self._waiter: asyncio.Future[None] | None = None  # its reader's, while it waits for one
        self.ended = False

    def put(self, event: Event) -> None:
        """The next event (on the event loop): queued, its reader woken. (A deque and one future,
        not an ``asyncio.Queue``: its getters' and putters' bookkeeping at every piece of a stream.)"""
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next(self) -> Event:
        while not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        event = self._events.popleft()
        if event.kind != "text":
            self.ended = True
        return event

    def cancel(self) -> None:
        """The client went away: the core ends the turn at its next token (it commits)."""
        if not self.ended:
            self.ended = True
            self._client.cancel(self.rid)


class CoreProcess:
    """One started core: its process and the line it said when it came up."""

    def __init__(self, config: wire.CoreConfig, started: subprocess.Popen[bytes] | None = None) -> None:
        """``started``: the core's process already started (importing while it waits for its
        configuration on stdin: ``coli-kv serve`` starts it first); used when it runs CORE_MODULE."""
        if started is not None and started.args != [sys.executable, "-m", CORE_MODULE]:  # a launcher swapped it
            assert started.stdin is not None
            started.stdin.close()  # it exits without a configuration
            started.wait()
            started = None
        self.proc = started or subprocess.Popen([sys.executable, "-m", CORE_MODULE], stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, env={**os.environ})
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode(config))
        self.proc.stdin.close()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> wire.Ready:
        """The core's :class:`Ready` (blocking); a ColiError with its one line if it failed."""
        assert self.proc.stdout is not None
        fd, buf, deadline = self.proc.stdout.fileno(), b"", time.monotonic() + timeout
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise ColiError(f"the engine process did not start in {timeout:.0f} s")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    code = self.proc.wait()
                    raise ColiError(f"the engine process exited ({code}) before it was ready")
                buf += chunk
        self.proc.stdout.close()
        said = msgspec.json.decode(buf.split(b"\n", 1)[0], type=wire.Ready | wire.StartFailed)
        if isinstance(said, wire.StartFailed):
            self.proc.wait()
            raise ColiError(said.message)
        return said

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()


class CoreClient:
    """Starts, talks to and supervises the engine core of one server."""

    def __init__(self, config: dict[str, Any], started: subprocess.Popen[bytes] | None = None) -> None:
        """``config``: :class:`CoreConfig`'s fields but the sockets and the parent's pid; ``started``:
        the first core's process, already importing (:class:`CoreProcess`)."""
        self._started = started
        self._dir, requests, events = wire.socket_paths()
        self.config = wire.CoreConfig(**config, requests=requests, events=events, parent_pid=os.getpid())
        self._sync = zmq.Context()
        self._push = self._sync.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.bind(requests)
        self._pull = self._sync.socket(zmq.PULL)  # read on the event loop's own reader (attach)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(events)
        self._fd = self._pull.fileno()  # signals a change of the socket's state (edges only)
        self._reading: asyncio.AbstractEventLoop | None = None  # the loop its reader is on, once attached
        self._ids = itertools.count(1)
        self._streams: dict[int, CoreStream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.core: CoreProcess | None = None
        self.ready: wire.Ready | None = None  # the running core's; None while none is ready
        self.stopping = False
        self.restarts = 0
        self.on_restart: list[Callable[[], object]] = []  # run when a new core is up

    # ---- life ------------------------------------------------------------------------------------
    def start(self) -> wire.Ready:
        """Start the first core and wait until it is ready (blocking: before the server listens)."""
        self.core = CoreProcess(self.config, self._started)
        self._started = None
        try:
            self.ready = self.core.wait_ready()
        except BaseException:
            self.close()
            raise
        return self.ready

    def attach(self) -> None:
        """Start receiving and watching on the running event loop (the server's lifespan)."""
        self._reading = asyncio.get_running_loop()
        self._reading.add_reader(self._fd, self._receive)
        self._receive()  # what arrived before the reader was added (the socket's fd signals edges only)
        self._tasks = [asyncio.create_task(self._watch())]

    async def _watch(self) -> None:
        while not self.stopping:
            await asyncio.sleep(WATCH_S)
            core = self.core
            if core is None or self.stopping or core.proc.poll() is None:
                continue
            self._core_died(core.proc.returncode)
            await self._restart()

    def _core_died(self, code: int) -> None:
        self.ready = None
        log.error("core.died", exit=code)
        err = ApiError(503, f"the engine process died ({'signal ' + str(-code) if code < 0 else 'exit ' + str(code)})"
                       "; the session keeps what it had committed", code="engine_restarted")
        streams, calls = self._streams, self._calls
        self._streams, self._calls = {}, {}
        for stream in streams.values():
            stream.put(Event("error", err))
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(err)

    async def _restart(self) -> None:
        while not self.stopping:
            try:
                self.core = CoreProcess(self.config)
                core = self.core
                self.ready = await asyncio.to_thread(core.wait_ready)
            except ColiError as exc:
                log.error("core.start_failed", error=str(exc))
                await asyncio.sleep(RESTART_PAUSE_S)
                continue
            self.restarts += 1
            for hook in self.on_restart:
                hook()
            log.info("core.restarted", pid=self.ready.pid)
            return

    def _receive(self) -> None:
        """Every message the core has sent so far, routed (the socket's reader on the event loop).

        A plain reader, not ``zmq.asyncio``'s ``await recv()``: that makes a future and re-arms the
        reader for every message, which was a fifth of this process's time while one stream ran
        (a message a step). The socket's fd only signals a change, so it is drained while its events say
        a message waits."""
        pull = self._pull
        while int(pull.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # (asking also arms the fd's next edge)
            try:
                data = pull.recv(zmq.NOBLOCK)
            except zmq.Again:  # (not raised while events say a message waits; an exception costs more)
                continue
            for event in wire.decode_from_core(data):
                self._route(event)

    def _route(self, event: wire.Piece | wire.TurnDone | wire.Result | wire.Failed) -> None:
        rid = event.rid
        if isinstance(event, wire.Piece):
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put(Event("text", event.text, event.logprobs))
            return
        stream = self._streams.pop(rid, None)
        if stream is not None:
            stream.put(Event("done", event.outcome) if isinstance(event, wire.TurnDone)
                                    else Event("error", error_of(event.error) if isinstance(event, wire.Failed)
                                               else ApiError(500, "the engine answered a turn with a result")))
            return
        fut = self._calls.pop(rid, None)
        if fut is None or fut.done():
            return
        if isinstance(event, wire.Result):
            fut.set_result(event.value)
        elif isinstance(event, wire.Failed):
            fut.set_exception(error_of(event.error))

    def drain(self) -> None:
        """The server stops: the core refuses new work and ends running turns at their next token."""
        self.stopping = True
        self._send(wire.Drain(shutdown=False))

    def stop(self) -> int | None:
        """Tell the core to commit everything and exit; wait for it (the API process's last step)."""
        self.stopping = True
        for task in self._tasks:
            task.cancel()
        self._stop_reading()
        code = None
        core = self.core
        if core is not None and core.proc.poll() is None:
            self._send(wire.Drain(shutdown=True))
            try:
                code = core.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.error("core.stop_timeout", seconds=STOP_TIMEOUT_S)
                core.kill()
        elif core is not None:
            code = core.proc.returncode
        self.close()
        return code

    def detach(self) -> None:
        """Stop receiving (on the event loop :meth:`attach` ran on, as it ends: the server's lifespan)."""
        self._stop_reading()

    def _stop_reading(self) -> None:
        loop, self._reading = self._reading, None
        if loop is None or loop.is_closed():
            return
        fd = self._fd
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or not loop.is_running():
            loop.remove_reader(fd)
        else:  # another thread's loop: it removes its reader itself
            loop.call_soon_threadsafe(loop.remove_reader, fd)

    def close(self) -> None:
        self._stop_reading()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._sync.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- requests --------------------------------------------------------------------------------
    def _send(self, message: wire.ToCore) -> None:
        self._push.send(wire.encode_message(message))

    def _check(self) -> None:
        if self.stopping:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if self.ready is None:
            raise unavailable()

    def turn(self, spec: wire.TurnSpec, response: wire.ResponseJob | None = None) -> CoreStream:
        """Queue one turn; the stream its events come on."""
        self._check()
        rid = next(self._ids)
        stream = self._streams[rid] = CoreStream(self, rid)
        self._send(wire.TurnCall(rid, spec, response))
        return stream

    def cancel(self, rid: int) -> None:
        if rid in self._streams and self.ready is not None:
            self._send(wire.Cancel(rid))

    async def call(self, op: str, **args: Any) -> Any:
        """One of the core's operations (:data:`sessionstore.service.engine.operations.OPERATIONS`); its value."""
        self._check()
        rid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[rid] = fut
        self._send(wire.Call(rid, op, args))
        try:
            return await fut
        finally:
            self._calls.pop(rid, None)

    @property
    def pid(self) -> int | None:
        return None if self.ready is None else self.ready.pid


__all__ = ["CoreClient", "CoreProcess", "CoreStream", "HeldElsewhere", "error_of"]
