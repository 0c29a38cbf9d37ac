"""``coli-kv serve --root R --inbox DIR``: import every bundle that lands in DIR until stopped;
``coli-kv serve --http [HOST:]PORT --root R --model M``: the chat service (OpenAI-compatible HTTP
API over persistent sessions, :mod:`sessionstore.service`); both can run in one process.

Complete bundles already in DIR are imported at start, then every one renamed into it (writers
drop ``*.partial`` and rename) or closed after writing; each is moved to ``DIR/done/`` or
``DIR/failed/`` (with ``<name>.reason``). Every step is logged (structlog; ``COLI_LOG=json`` for
JSON lines). SIGTERM or SIGINT: the bundle being imported finishes, then a clean exit 0.
With ``--once`` the exit status says whether every bundle imported: 1 (and one stderr line naming
the first failure) when any went to ``failed/``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

from kernels.errors import ColiError, FormatError
from kernels.rows import KV_DTYPES
from sessionstore.log import reconfigure
from sessionstore.migration import Inbox
from sessionstore.service import API_KEY_ENV, DEFAULT_HOST, PULL_KEY_ENV, ServiceLimits, check_bind, parse_bind
from sessionstore.sessions import DURABLE_STREAM
from tools import early_core
from tools._common import fresh_store


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve sessions over HTTP (--http) and/or import every bundle that "
                              "lands in an inbox directory (--inbox)")
    p.add_argument("--root", required=True, help="session store directory")
    p.add_argument("--inbox", default=None, help="directory to watch")
    p.add_argument("--replace", action="store_true", help="bundles replace existing sessions")
    p.add_argument("--model", default=None, help="the model served (--http: required; dir, 'tiny' or 'glm-mini');"
                   " the inbox refuses bundles of any other model")
    p.add_argument("--http", default=None, metavar="[HOST:]PORT",
                   help=f"serve the HTTP API here (host default {DEFAULT_HOST}; port 0: any free port, printed)")
    p.add_argument("--kv", choices=KV_DTYPES, default="fp8", help="latent cache dtype of new sessions (default fp8)")
    p.add_argument("--api-key", default=None, help=f"require Authorization: Bearer KEY (or set {API_KEY_ENV}); "
                   "needed to listen on a non-loopback address")
    p.add_argument("--max-resident", type=int, default=ServiceLimits.max_resident,
                   help=f"sessions resident at once (default {ServiceLimits.max_resident}); the least recently "
                   "used idle one is suspended")
    p.add_argument("--max-kv-bytes", type=int, default=None, help="resident KV bytes at most (default: no bound)")
    p.add_argument("--max-prefill-tokens", type=int, default=ServiceLimits.max_prefill_tokens,
                   help="prompt tokens one engine step carries beside the running streams' decode tokens "
                        f"(default {ServiceLimits.max_prefill_tokens}): a long prompt is admitted over several "
                        "steps while the others keep streaming; tokens are the same for any value")
    p.add_argument("--prefill-step-ratio", type=int, default=ServiceLimits.prefill_step_ratio, metavar="R",
                   help="beside running streams, a step's prompt chunk is sized (from the steps measured) to "
                        f"take at most R decode-only steps (default {ServiceLimits.prefill_step_ratio}; at most "
                        "--max-prefill-tokens tokens); 0: no pacing, always --max-prefill-tokens")
    p.add_argument("--whole-prompt-tokens", type=int, default=ServiceLimits.whole_prompt_tokens, metavar="N",
                   help="beside running streams, a step takes prompts of at most N tokens whole, up to N tokens "
                        f"of them (default {ServiceLimits.whole_prompt_tokens}): a new turn's first token does not "
                        "wait for paced chunks; longer prompts are paced; 0: every prompt paced")
    p.add_argument("--read-timeout", type=int, default=ServiceLimits.read_timeout_s, metavar="S",
                   help=f"seconds a client may take to send a request's headers, a JSON body whole, or any gap "
                        f"in a body (default {ServiceLimits.read_timeout_s}); past it the request is cut (408)")
    p.add_argument("--max-bundle-bytes", type=int, default=ServiceLimits.max_bundle_bytes,
                   help=f"largest bundle PUT /v1/sessions/ID/bundle accepts (default {ServiceLimits.max_bundle_bytes})")
    p.add_argument("--commit-every", type=int, default=16, help="commit a reply every N tokens (default 16)")
    p.add_argument("--durable-stream", action=argparse.BooleanOptionalAction, default=DURABLE_STREAM,
                   help="send a token to the client only once it is committed (every token commits, one group "
                   "commit per decode step for the whole batch): a crash never loses text a client was sent "
                   f"(default {'on' if DURABLE_STREAM else 'off'})")
    p.add_argument("--remote", default=None, metavar="s3://BUCKET/PREFIX",
                   help="--http: serve as one host of a fleet on this object store (sessions leased, pulled "
                   "and pushed back; endpoint and credentials from the AWS environment, e.g. AWS_ENDPOINT_URL)")
    p.add_argument("--host-id", default=None, help="--remote: who holds leases (default: $COLI_HOST_ID or hostname)")
    p.add_argument("--lease-ttl", type=float, default=None, help="--remote: lease lifetime in seconds (default 900)")
    p.add_argument("--ship-every-commit", action="store_true",
                   help="--remote: ship each commit inside a reply too (every --commit-every tokens), not only "
                   "each finished turn; a host lost mid-reply then loses at most the tokens since the last commit")
    p.add_argument("--advertise-url", default=None, metavar="http://HOST:PORT",
                   help="--remote: where the other hosts reach this server; written into the leases it holds, "
                   "so a request for one of its sessions that reaches another host is redirected here (307)")
    p.add_argument("--max-disk-bytes", type=int, default=None, metavar="B",
                   help="--http: the sessions' kv files on this disk at most (default: no bound); with --remote the "
                   "least recently used idle sessions past it are offloaded to the object store (a request restores "
                   "one), without it a turn that could pass it is refused with 507")
    p.add_argument("--sweep-interval", type=float, default=30.0, metavar="S",
                   help="--http: seconds between sweeps that delete sessions past their retention_seconds and "
                   "offload past --max-disk-bytes (default 30)")
    p.add_argument("--fleet-proxy", action="store_true",
                   help="--remote: forward a request for a session another live host holds to that host (its "
                   "--advertise-url) and stream its answer back, instead of answering 307")
    p.add_argument("--pull-from", action="append", default=[], metavar="ORIGIN",
                   help="--http: a server (scheme://host:port) that POST /v1/sessions/ID/pull may fetch sessions "
                   "from; repeat for more (default: none, pulls refused)")
    p.add_argument("--pull-key", default=None, help=f"--pull-from: the bearer key sent to those servers (or set "
                   f"{PULL_KEY_ENV})")
    p.add_argument("--pull-timeout", type=float, default=60.0,
                   help="--pull-from: seconds a pull waits for a silent peer before it gives up (default 60)")
    p.add_argument("--once", action="store_true", help="import what is there now, then exit (1 if any failed)")
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    reconfigure()
    if args.http is None and args.inbox is None:
        raise FormatError("give --http [HOST:]PORT, --inbox DIR or both")
    if args.http is None and (args.remote or args.host_id or args.lease_ttl is not None):
        raise FormatError("--remote, --host-id and --lease-ttl are for --http")
    if args.http is None and args.max_disk_bytes is not None:
        raise FormatError("--max-disk-bytes is for --http")
    if args.ship_every_commit and not args.remote:
        raise FormatError("--ship-every-commit is for --remote (it ships to the fleet's object store)")
    if args.fleet_proxy and not args.remote:
        raise FormatError("--fleet-proxy is for --remote (it forwards to the host that holds a session)")
    if args.advertise_url is not None and not args.remote:
        raise FormatError("--advertise-url is for --remote (a fleet's hosts redirect to each other)")
    if args.http is not None:
        return run_http(args)
    return run_inbox(args)


def run_http(args: argparse.Namespace) -> int:
    """The HTTP service (with the inbox watched beside it when --inbox is given)."""
    if args.once:
        raise FormatError("--once is for --inbox alone")
    if not args.model:
        raise FormatError("--http needs --model (a checkpoint directory, 'tiny' or 'glm-mini')")
    if args.max_resident < 1 or args.commit_every < 1 or args.max_prefill_tokens < 1 or args.read_timeout < 1:
        raise FormatError("--max-resident, --commit-every, --max-prefill-tokens and --read-timeout must be >= 1")
    if args.prefill_step_ratio < 0 or args.whole_prompt_tokens < 0:
        raise FormatError("--prefill-step-ratio and --whole-prompt-tokens must be >= 0")
    if (args.max_kv_bytes is not None and args.max_kv_bytes < 1) or args.max_bundle_bytes < 1:
        raise FormatError("--max-kv-bytes and --max-bundle-bytes must be >= 1")
    if args.max_disk_bytes is not None and args.max_disk_bytes < 1:
        raise FormatError("--max-disk-bytes must be >= 1")
    if not args.sweep_interval > 0:
        raise FormatError("--sweep-interval must be > 0")
    host, port = parse_bind(args.http)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    check_bind(host, api_key)
    try:  # the service extra: imported here only (the README's install leaves it out)
        import uvicorn  # noqa: F401 - serve_http imports it when it starts listening

        from sessionstore.service.fleet.bundle_pull import PullPolicy
        from sessionstore.service.http import ServeConfig, serve_http
    except ImportError as exc:
        raise missing_extra(exc) from None

    try:
        if args.pull_timeout <= 0:
            raise ValueError("--pull-timeout must be > 0")
        pull = PullPolicy.of(args.pull_from, args.pull_key or os.environ.get(PULL_KEY_ENV) or None,
                             args.pull_timeout)
    except ValueError as exc:
        raise FormatError(str(exc) if str(exc).startswith("--") else f"--pull-from {exc}") from None

    config = ServeConfig(root=args.root, model=args.model, host=host, port=port, kv_dtype=args.kv, api_key=api_key,
                         limits=ServiceLimits(max_resident=args.max_resident, max_bundle_bytes=args.max_bundle_bytes,
                                              max_prefill_tokens=args.max_prefill_tokens,
                                              prefill_step_ratio=args.prefill_step_ratio,
                                              whole_prompt_tokens=args.whole_prompt_tokens,
                                              read_timeout_s=args.read_timeout),
                         max_kv_bytes=args.max_kv_bytes,
                         commit_every=args.commit_every, durable_stream=args.durable_stream,
                         remote=args.remote, host_id=args.host_id, lease_ttl=args.lease_ttl,
                         advertise_url=args.advertise_url, fleet_proxy=args.fleet_proxy,
                         ship_every_commit=args.ship_every_commit,
                         pull=pull if pull.origins else None, max_disk_bytes=args.max_disk_bytes,
                         sweep_interval=args.sweep_interval)
    if args.inbox is None:
        return serve_http(config, core_process=early_core.take())
    stop = threading.Event()
    with fresh_store(args.root) as store:
        inbox = Inbox(store, args.inbox, replace=args.replace, model=args.model)
    watcher = threading.Thread(target=inbox.run, args=(stop,), name="coli-inbox", daemon=True)
    watcher.start()
    try:
        return serve_http(config, core_process=early_core.take())
    finally:
        stop.set()
        watcher.join()


OUR_PACKAGES = ("kernels", "sessionstore", "tools")
SERVICE_INSTALL = 'pip install -e ".[service]"'


def missing_extra(exc: ImportError) -> ColiError:
    """The one-line error for ``--http`` without the ``service`` extra (a module of ours that fails
    to import is a bug: its error is raised as it is)."""
    missing = (exc.name or "").partition(".")[0]
    if not missing or missing in OUR_PACKAGES:
        raise exc
    return ColiError(f"--http needs the service extra ({missing} is not installed): {SERVICE_INSTALL}")


def run_inbox(args: argparse.Namespace) -> int:
    with fresh_store(args.root) as store:  # a refused inbox leaves no empty store behind
        inbox = Inbox(store, args.inbox, replace=args.replace, model=args.model)
    if args.once:
        inbox.scan()
        outcomes = inbox.drain()
    else:
        stop = threading.Event()

        def on_signal(signum: int, _frame: Any) -> None:
            stop.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            outcomes = inbox.run(stop)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    ok = sum(o.ok for o in outcomes)
    print(f"serve: {ok} bundle(s) imported, {len(outcomes) - ok} failed")
    if args.json:
        print(json.dumps({"imported": ok, "failed": len(outcomes) - ok,
                          "outcomes": [o.to_json() for o in outcomes]}))
    failed = [o for o in outcomes if not o.ok]
    if args.once and failed:
        print(f"coli-kv serve: error: {len(failed)} bundle(s) failed, the first {failed[0].name}: "
              f"{failed[0].reason} (moved to {failed[0].moved_to}, reason beside it)", file=sys.stderr)
        return 1
    return 0
