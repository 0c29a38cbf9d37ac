"""Running the service: the bind rule, the engine core's process (:mod:`sessionstore.service.engine.process`,
started and supervised by :class:`~sessionstore.service.http.core_client.CoreClient`), uvicorn on a socket
we bound, and the shutdown order (SIGTERM/SIGINT: stop accepting, cut running turns at a token
boundary, then the core commits and suspends every session and exits; exit 0)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from kernels.errors import ColiError
from sessionstore.kvfile import hash_without_compiled_code
from sessionstore.log import get_logger
from sessionstore.service.bind import DEFAULT_HOST, check_bind
from sessionstore.service.fleet.bundle_pull import PullPolicy
from sessionstore.service.fleet.proxy import FleetProxy
from sessionstore.service.http.app import ServerContext, build_app
from sessionstore.service.http.core_client import CoreClient
from sessionstore.service.http.metrics import HttpMetrics
from sessionstore.service.http.slow_clients import guarded_protocol
from sessionstore.service.limits import ServiceLimits
from sessionstore.service.wire import DEFAULT_SWEEP_INTERVAL_S, load_tokenizer
from sessionstore.sessions import DEFAULT_COMMIT_EVERY, DURABLE_STREAM, SessionStore

GRACEFUL_SHUTDOWN_S = 30  # the longest uvicorn waits for open streams once turns were cut
# The GIL hand-over interval while serving (CPython's default is 5 ms). The engine thread lets go of
# the GIL in every compiled kernel of a decode step; a turn or the event loop takes it meanwhile,
# and the engine then waits up to this long to get it back, once per kernel. Streaming one
# session over HTTP on glm-mini, measured: 85-87 tokens/s at 5 ms, 102-127 at 0.2 ms.
SWITCH_INTERVAL_S = 0.0005

log = get_logger("service")


@dataclass
class ServeConfig:
    root: str
    model: str
    host: str = DEFAULT_HOST
    port: int = 8000
    kv_dtype: str = "fp8"
    api_key: str | None = None
    limits: ServiceLimits = field(default_factory=ServiceLimits)
    max_kv_bytes: int | None = None
    commit_every: int | None = DEFAULT_COMMIT_EVERY  # each session's (SessionOptions), as the core opens it
    durable_stream: bool = DURABLE_STREAM  # commit at every generated token (SessionOptions); serve's default
    remote: str | None = None  # s3://bucket/prefix: one host of a fleet (sessionstore.service.fleet)
    host_id: str | None = None  # who holds leases (default: $COLI_HOST_ID or the host name)
    lease_ttl: float | None = None  # seconds (default LEASE_TTL_S)
    advertise_url: str | None = None  # where the fleet reaches this server: written into its leases (307s)
    fleet_proxy: bool = False  # forward a request for a session held elsewhere to its holder (else 307)
    ship_every_commit: bool = False  # --remote: ship at each commit inside a turn too (FORMAT.md 6.7)
    pull: PullPolicy | None = None  # the peers POST /v1/sessions/ID/pull may fetch from (--pull-from)
    max_disk_bytes: int | None = None  # the sessions' kv files on this disk at most (tiers.TierManager)
    sweep_interval: float = DEFAULT_SWEEP_INTERVAL_S  # seconds between sweeps (retention, the disk budget)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ColiError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def core_settings(config: ServeConfig) -> dict[str, Any]:
    """The engine core's settings (:class:`~sessionstore.service.wire.ipc.CoreConfig` but its sockets)."""
    return {"root": str(config.root), "model": config.model, "kv_dtype": config.kv_dtype,
            "limits": dict(config.limits.__dict__), "commit_every": config.commit_every,
            "durable_stream": config.durable_stream,
            "max_kv_bytes": config.max_kv_bytes, "remote": config.remote, "host_id": config.host_id,
            "lease_ttl": config.lease_ttl, "advertise_url": config.advertise_url,
            "max_disk_bytes": config.max_disk_bytes, "sweep_interval": config.sweep_interval,
            "ship_every_commit": config.ship_every_commit}


def serve_http(config: ServeConfig, *, on_ready: Callable[[dict[str, Any]], None] | None = None,
               core_process: subprocess.Popen[bytes] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns 0 once the core has committed every session.
    ``core_process``: the engine core's process, started early (``coli-kv serve``), else one is started."""
    import uvicorn

    from kernels.model import resolve_model

    check_bind(config.host, config.api_key)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    source = resolve_model(config.model)
    sock = bind_socket(config.host, config.port)
    core = CoreClient(core_settings(config), core_process)
    try:
        ready_core = core.start()  # the store opened, the model loaded: or one line saying why not
    except BaseException:
        sock.close()
        raise
    hash_without_compiled_code()  # this process computes nothing: its bundle exports' checks use the binding
    store = SessionStore(config.root, sweep=False)  # read by bundles' transfer (the core owns the sessions)
    ctx = ServerContext(core, ready_core.model, ready_core.vocab_size, source, load_tokenizer(source), store,
                        config.limits, HttpMetrics(), config.pull,
                        FleetProxy(ready_core.host_id or "") if config.fleet_proxy else None)
    core.on_restart.append(ctx.metrics.engine_restarts.inc)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            core.drain()  # new turns refused; the running ones end at their next token and commit
            super().handle_exit(sig, frame)

    uv_config = uvicorn.Config(build_app(ctx, config.api_key), log_level="warning", lifespan="on",
                               timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False,
                               http=guarded_protocol(config.limits.read_timeout_s))  # slow clients are cut
    server = Server(uv_config)
    host, port = sock.getsockname()[:2]
    ready = {"event": "listening", "url": f"http://{'[' + host + ']' if ':' in host else host}:{port}",
             "model": ready_core.model, "pid": os.getpid(), "engine_pid": ready_core.pid}
    if ready_core.remote is not None:
        ready.update(remote=ready_core.remote, host_id=ready_core.host_id)
    # uvicorn re-raises the signal it caught once it has stopped; this handler absorbs it so the
    # shutdown below (the core commits every session) runs and the exit status is 0
    previous = {s: signal.signal(s, lambda _s, _f: None) for s in (signal.SIGTERM, signal.SIGINT)}
    code: int | None = 0
    try:
        if on_ready is not None:
            on_ready(ready)
        else:
            print(json.dumps(ready), flush=True)
        server.run(sockets=[sock])
    finally:
        code = core.stop()
        sock.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    sessions = len(store.directory.ids())
    log.info("service.stopped", sessions=sessions, engine_exit=code)
    print(json.dumps({"event": "stopped", "sessions": sessions}), file=sys.stderr, flush=True)
    return 0 if code in (0, None) else 1


__all__ = ["ServeConfig", "bind_socket", "core_settings", "serve_http"]
