"""Running the service: the bind rule, the store and the engine, uvicorn on a socket we bound,
and the shutdown order (SIGTERM/SIGINT: stop accepting, cut running turns at a token boundary,
commit and suspend every session, exit 0)."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from kernels.errors import ColiError
from sessionstore.kvfile.hash_helper import start_hash_helper, stop_hash_helper
from sessionstore.log import get_logger
from sessionstore.service.app import build_app
from sessionstore.service.bind import DEFAULT_HOST, check_bind
from sessionstore.service.bundle_pull import PullPolicy
from sessionstore.service.engine import Engine
from sessionstore.service.limits import ServiceLimits
from sessionstore.service.tiers import DEFAULT_SWEEP_INTERVAL_S, Sweeper, TierManager
from sessionstore.sessions import SessionStore

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
    session_options: dict[str, Any] = field(default_factory=dict)
    remote: str | None = None  # s3://bucket/prefix: one host of a fleet (sessionstore.service.fleet)
    host_id: str | None = None  # who holds leases (default: $COLI_HOST_ID or the host name)
    lease_ttl: float | None = None  # seconds (default LEASE_TTL_S)
    advertise_url: str | None = None  # where the fleet reaches this server: written into its leases (307s)
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


def load_tokenizer(model_source: str) -> Any:
    """The model's tokenizer and chat template, or None for a model without text files."""
    try:
        from kernels.model.text import load_text
    except ImportError:
        return None
    try:
        return load_text(model_source)
    except (ColiError, OSError):
        return None


def fleet_home(config: ServeConfig, store: SessionStore, model_source: str) -> Any:
    """The fleet's side of this server (``--remote``), its store checked reachable; or None."""
    if config.remote is None:
        return None
    from sessionstore.migration import LEASE_TTL_S, RemoteStore
    from sessionstore.service.fleet import SessionHome

    ttl = LEASE_TTL_S if config.lease_ttl is None else config.lease_ttl
    remote = RemoteStore(store, config.remote, host_id=config.host_id, lease_ttl=ttl,
                         advertise_url=config.advertise_url)
    home = SessionHome(remote, model=model_source)
    home.probe()
    return home


def serve_http(config: ServeConfig, *, on_ready: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns 0 once every session is committed."""
    import uvicorn

    from kernels.model import resolve_model

    check_bind(config.host, config.api_key)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    source = resolve_model(config.model)
    store = SessionStore(config.root)
    home = fleet_home(config, store, source)
    engine = Engine(store, source, kv_dtype=config.kv_dtype, tokenizer=load_tokenizer(source),
                    limits=config.limits, session_options=config.session_options, max_kv_bytes=config.max_kv_bytes,
                    home=home)
    engine.tiers = TierManager(engine, max_disk_bytes=config.max_disk_bytes)  # tiers hook (FORMAT.md 5.10)
    sweeper = Sweeper(engine.tiers, config.sweep_interval).start()
    sock = bind_socket(config.host, config.port)
    start_hash_helper()  # resumes share their checksum pass with a second process (stopped below)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            engine.stopping.set()  # new turns refused; the running one ends at its next token
            super().handle_exit(sig, frame)

    uv_config = uvicorn.Config(build_app(engine, config.api_key, config.pull), log_level="warning", lifespan="off",
                               timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False)
    server = Server(uv_config)
    host, port = sock.getsockname()[:2]
    ready = {"event": "listening", "url": f"http://{'[' + host + ']' if ':' in host else host}:{port}",
             "model": engine.model_ref.name, "pid": os.getpid()}
    if home is not None:
        ready.update(remote=home.url, host_id=home.host_id)
    # uvicorn re-raises the signal it caught once it has stopped; this handler absorbs it so the
    # shutdown below (commit every session) runs and the exit status is 0
    previous = {s: signal.signal(s, lambda _s, _f: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if on_ready is not None:
            on_ready(ready)
        else:
            print(json.dumps(ready), flush=True)
        server.run(sockets=[sock])
    finally:
        sweeper.stop()
        engine.stop()
        stop_hash_helper()
        sock.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.info("service.stopped", sessions=len(store.ids()))
    print(json.dumps({"event": "stopped", "sessions": len(store.ids())}), file=sys.stderr, flush=True)
    return 0


__all__ = ["ServeConfig", "bind_socket", "fleet_home", "load_tokenizer", "serve_http"]
