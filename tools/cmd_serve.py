"""``coli-kv serve --root R --inbox DIR``: import every bundle that lands in DIR until stopped.

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
import signal
import sys
import threading
from typing import Any

from sessionstore.log import reconfigure
from sessionstore.migration import Inbox
from tools._common import fresh_store


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="watch an inbox directory and import every bundle that lands")
    p.add_argument("--root", required=True, help="session store directory")
    p.add_argument("--inbox", required=True, help="directory to watch")
    p.add_argument("--replace", action="store_true", help="bundles replace existing sessions")
    p.add_argument("--model", default=None, help="refuse bundles of any other model (dir or 'tiny')")
    p.add_argument("--once", action="store_true", help="import what is there now, then exit (1 if any failed)")
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    reconfigure()
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
