"""The engine core's process (``python -m sessionstore.service.engine.process``, started by the API
process of ``coli-kv serve --http``): it owns the decoder, the store's sessions and the fleet's
leases, and answers requests that arrive as data (:mod:`sessionstore.service.wire.ipc`).

It reads its :class:`~sessionstore.service.wire.wire.CoreConfig` (JSON) on stdin, builds the
:class:`Engine`, connects to the API process's two sockets and prints one JSON line on stdout:
``Ready`` or ``StartFailed``. Then its main thread receives requests and hands them to the engine
loop as jobs (:mod:`sessionstore.service.steps.loop`); the loop sends the events of each of its
passes as one message, and a sender thread those put by other threads (:class:`Outbox`).

It stops (commit and suspend every session, exit 0) on ``Drain(shutdown=True)``, on SIGTERM, and
when its parent is gone; should the engine loop's thread die (a bug), it exits 1 and its API
process starts a new core (the kernel's parent-death signal on Linux, and a check of the parent's pid
every poll, so a SIGKILLed API process leaves no orphan core). SIGINT is ignored: a terminal's
Ctrl-C reaches the API process, which drains the core itself.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import zmq

from kernels.errors import ColiError
from sessionstore.log import get_logger
from sessionstore.migration import HeldElsewhereError
from sessionstore.service import wire
from sessionstore.service.engine.engine import Engine
from sessionstore.service.engine.operations import OPERATIONS, fleet_responses
from sessionstore.service.engine.response_job import StoredResponseTurn
from sessionstore.service.engine.tiers import Sweeper
from sessionstore.service.errors import api_error_of
from sessionstore.service.limits import ServiceLimits
from sessionstore.service.wire import ResponseRecords, TurnOutcome, load_tokenizer
from sessionstore.sessions import SessionOptions, SessionStore

log = get_logger("service.core")

POLL_MS = 200  # how often the main thread looks up from its socket (stop flags, the parent's pid)
READERS = 4  # threads for the operations that only read (listings, descriptions, metrics)
PR_SET_PDEATHSIG = 1


def error_info(exc: BaseException) -> wire.ErrorInfo:
    """``exc`` as it crosses to the API process (an internal error is logged here with its traceback)."""
    if isinstance(exc, HeldElsewhereError):
        return wire.ErrorInfo(409, str(exc), code="session_held", holder_url=exc.holder_url, held=True)
    err = api_error_of(exc)
    if err.status >= 500 and err.code is None:
        log.error("core.internal_error", error=repr(exc), trace="".join(traceback.format_exception(exc)))
    return wire.ErrorInfo(err.status, err.message, code=err.code, param=err.param)


class Outbox:
    """Events for the API process, put from any thread, sent in order over one socket as few
    messages as possible. An event put on the engine loop's thread (a turn's text and its end) waits
    for the loop's :meth:`flush` before its pass's step (what its jobs put: a turn's first piece waits
    for no step of the others) or at the pass's end, so a batched step's pieces travel as one message
    and the loop never hands the GIL to a sender thread per piece; an event put elsewhere (a
    reader's result, a durable-stream piece released by a commit thread) wakes the sender thread.
    Every send takes whatever is queued, in the order it was put, under one lock: the two senders
    never reorder a request's events."""

    def __init__(self, socket: zmq.Socket[bytes], on_loop: Callable[[], bool]) -> None:
        self._socket, self._on_loop = socket, on_loop
        self._cond = threading.Condition()  # guards the queue, the socket and the closed flag
        self._events: list[wire.FromCore] = []
        self._closed = False
        self._thread = threading.Thread(target=self._send, name="coli-core-outbox", daemon=True)
        self._thread.start()

    def put(self, event: wire.FromCore) -> None:
        with self._cond:
            self._events.append(event)
            if not self._on_loop():
                self._cond.notify()

    def flush(self) -> None:
        """Send what is queued now (the engine loop, at the end of each pass)."""
        with self._cond:
            self._send_queued()

    def _send_queued(self) -> None:
        if self._events:
            batch, self._events = self._events, []
            self._socket.send(wire.encode_message(batch))

    def _send(self) -> None:
        with self._cond:
            while True:
                while not self._events and not self._closed:
                    self._cond.wait()
                self._send_queued()
                if self._closed:
                    return

    def close(self) -> None:
        """Send what is queued, then stop the sender."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)


class CoreSink:
    """One turn's :class:`~sessionstore.service.engine.turns.TurnSink`: its text goes to the outbox; the
    API process's :class:`Cancel` marks it cancelled."""

    def __init__(self, rid: int, outbox: Outbox) -> None:
        self.rid, self._outbox = rid, outbox
        self._cancelled = threading.Event()

    def text(self, piece: str, logprobs: Any = None) -> None:
        self._outbox.put(wire.Piece(self.rid, piece, logprobs))

    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()


class Core:
    """The core's dispatcher: each request becomes the engine's work (turns and changes) or a
    reader's (reads); what comes of it goes to the outbox under the request's id."""

    def __init__(self, engine: Engine, outbox: Outbox) -> None:
        self.engine, self.outbox = engine, outbox
        self.records = ResponseRecords(engine.store.root)
        self.readers = ThreadPoolExecutor(READERS, thread_name_prefix="coli-core-read")
        self._sinks: dict[int, CoreSink] = {}
        self._lock = threading.Lock()

    def handle(self, message: Any) -> bool:
        """Act on one request; False once the core should stop."""
        if isinstance(message, wire.TurnCall):
            self.turn(message)
        elif isinstance(message, wire.Call):
            self.call(message)
        elif isinstance(message, wire.Cancel):
            with self._lock:
                sink = self._sinks.get(message.rid)
            if sink is not None:
                sink.cancel()
        elif isinstance(message, wire.Drain):
            self.engine.stopping.set()  # new turns refused; running ones end at their next token
            return not message.shutdown
        return True

    def turn(self, call: wire.TurnCall) -> None:
        engine, metrics, rid = self.engine, self.engine.metrics, call.rid
        sink = CoreSink(rid, self.outbox)
        spec = call.spec
        job = None if call.response is None else StoredResponseTurn(engine, self.records, spec, call.response,
                                                                    fleet_responses(engine))

        started = threading.Event()

        def run() -> TurnOutcome:
            started.set()
            metrics.waiting.dec()
            metrics.running.inc()
            try:
                return job.run(sink) if job is not None else engine.run_turn(spec, sink)
            finally:
                metrics.running.dec()

        metrics.waiting.inc()
        with self._lock:  # before the turn can start: a Cancel that follows it finds its sink
            self._sinks[rid] = sink
        try:  # a cut stream's turn has ended: a request on its session waits for its commit
            fut = engine.submit(run, session=spec.session, turn=True, then=None if job is None else job.publish,
                                cut=sink.cancelled)
        except BaseException as exc:
            with self._lock:
                self._sinks.pop(rid, None)
            metrics.waiting.dec()
            self.outbox.put(wire.Failed(rid, error_info(exc)))
            return

        def deliver(done: Future[TurnOutcome]) -> None:
            with self._lock:
                self._sinks.pop(rid, None)
            if not started.is_set():  # refused while it waited for its session (409 past the bound, 503)
                metrics.waiting.dec()
            error = done.exception()
            self.outbox.put(wire.Failed(rid, error_info(error)) if error is not None
                            else wire.TurnDone(rid, done.result()))

        fut.add_done_callback(deliver)

    def call(self, call: wire.Call) -> None:
        operation = OPERATIONS.get(call.op)
        if operation is None:
            self.outbox.put(wire.Failed(call.rid, wire.ErrorInfo(400, f"no operation {call.op!r}",
                                                                 code="invalid_value")))
            return
        engine, args = self.engine, call.args
        try:
            if operation.exclusive:
                sid = args.get("sid")
                fut: Future[Any] = engine.submit(lambda: operation.fn(engine, args),
                                                 session=sid if isinstance(sid, str) else None)
            else:
                fut = self.readers.submit(operation.fn, engine, args)
        except BaseException as exc:
            self.outbox.put(wire.Failed(call.rid, error_info(exc)))
            return

        def deliver(done: Future[Any]) -> None:
            error = done.exception()
            self.outbox.put(wire.Failed(call.rid, error_info(error)) if error is not None
                            else wire.Result(call.rid, done.result()))

        fut.add_done_callback(deliver)

    def close(self) -> None:
        self.readers.shutdown(wait=True)


def watch_parent() -> None:
    """Ask the kernel for SIGTERM when the parent dies (Linux); elsewhere the poll loop checks."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def fleet_home(remote_url: str | None, host_id: str | None, lease_ttl: float | None, advertise_url: str | None,
               store: SessionStore, model_source: str, ship_every_commit: bool = False) -> Any:
    """The fleet's side of this server (``--remote``), its store checked reachable; or None."""
    if remote_url is None:
        return None
    from sessionstore.migration import LEASE_TTL_S, RemoteStore
    from sessionstore.service.fleet import FleetHome

    ttl = LEASE_TTL_S if lease_ttl is None else lease_ttl
    remote = RemoteStore(store, remote_url, host_id=host_id, lease_ttl=ttl, advertise_url=advertise_url)
    home = FleetHome(remote, model=model_source, ship_every_commit=ship_every_commit)
    home.probe()
    return home


def build_engine(config: wire.CoreConfig) -> Engine:
    """The store, the fleet's side (``--remote``) and the engine, as ``serve --http`` configured them."""
    from kernels.model import resolve_model

    source = resolve_model(config.model)
    store = SessionStore(config.root)
    home = fleet_home(config.remote, config.host_id, config.lease_ttl, config.advertise_url, store, source,
                      config.ship_every_commit)
    engine = Engine(store, source, kv_dtype=config.kv_dtype, tokenizer=load_tokenizer(source),
                    limits=ServiceLimits(**config.limits), session_options=SessionOptions(
                        commit_every=config.commit_every, durable_stream=config.durable_stream, lazy_logits=True),
                    max_kv_bytes=config.max_kv_bytes, home=home, max_disk_bytes=config.max_disk_bytes)
    return engine


def say(line: dict[str, Any] | msgspec.Struct) -> None:
    data = msgspec.json.encode(line) if isinstance(line, msgspec.Struct) else json.dumps(line).encode()
    os.write(1, data + b"\n")


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _s, _f: stop.set())
    watch_parent()
    data = sys.stdin.buffer.read()
    if not data:  # started early and not taken (tools/early_core.py: a refused argument, an error)
        return 0
    config = msgspec.json.decode(data, type=wire.CoreConfig)
    if os.getppid() != config.parent_pid:
        return 0  # the parent died before the death signal was asked for
    sys.setswitchinterval(0.0005)  # the engine thread's hand-over interval (see server.SWITCH_INTERVAL_S)
    from sessionstore.kvfile import start_hash_helper, stop_hash_helper, warm_record_hashing

    try:
        engine = build_engine(config)
    except (ColiError, OSError, ValueError) as exc:
        say(wire.StartFailed(str(exc)))
        return 1
    context = zmq.Context()
    requests = context.socket(zmq.PULL)
    events = context.socket(zmq.PUSH)
    for sock in (requests, events):
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    requests.connect(config.requests)
    events.connect(config.events)
    start_hash_helper()
    warm_record_hashing()  # not inside the first resume's pass
    outbox = Outbox(events, on_loop=lambda: threading.current_thread() is engine.loop.thread)
    engine.loop.after_pass = outbox.flush
    core = Core(engine, outbox)
    sweeper = Sweeper(engine.tiers, config.sweep_interval).start()  # retention, the disk budget
    say(wire.Ready(engine.model_ref.name, int(engine.model.config.vocab_size),
              int(engine.model.config.max_position_embeddings), os.getpid(),
              None if engine.home is None else engine.home.url, None if engine.home is None else engine.home.host_id))
    os.dup2(2, 1)  # stdout carried the one line; anything printed later goes to stderr
    poller = zmq.Poller()
    poller.register(requests, zmq.POLLIN)
    try:
        while not stop.is_set() and os.getppid() == config.parent_pid:
            if not engine.loop.thread.is_alive():  # a bug in the loop: end, the API process starts a new core
                log.critical("core.loop_died")
                return 1
            if not poller.poll(POLL_MS):
                continue
            data = requests.recv()
            try:
                message = wire.decode_to_core(data)
            except msgspec.ValidationError as exc:  # never from our API process: log, drop
                log.error("core.bad_message", error=str(exc))
                continue
            if not core.handle(message):
                break
    finally:
        sweeper.stop()
        engine.stop()  # cut running turns at their next token, commit and suspend every session
        core.close()
        stop_hash_helper()
        outbox.close()
        requests.close(linger=0)
        events.close()
        context.term()
    log.info("core.stopped", sessions=len(engine.store.directory.ids()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
