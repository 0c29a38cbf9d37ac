"""``coli-kv import-slot MODEL_DIR [--slot i] --root R`` and
``coli-kv export-slot --root R ID MODEL_DIR [--slot i]``: trade sessions with the engine's slots."""
from __future__ import annotations

import argparse
import json
from typing import Any

from sessionstore.sessions import SessionStore, export_slot, import_slot


def register(subparsers: Any) -> None:
    imp = subparsers.add_parser("import-slot", help="make a session from the engine's slot file")
    imp.add_argument("model_dir", metavar="MODEL_DIR", help="model directory holding .coli_kv[.i]")
    imp.add_argument("--slot", type=int, default=0, help="slot number (0: .coli_kv, i: .coli_kv.i)")
    imp.add_argument("--root", required=True, help="the session store directory")
    imp.add_argument("--id", dest="session_id", default=None, help="session id (default slot-<i>)")
    imp.add_argument("--replace", action="store_true", help="replace an existing session of that id")
    imp.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    imp.set_defaults(func=run_import)

    exp = subparsers.add_parser("export-slot", help="write a session as the engine's slot file")
    exp.add_argument("session_id", metavar="ID")
    exp.add_argument("model_dir", metavar="MODEL_DIR", help="model directory to write .coli_kv[.i] into")
    exp.add_argument("--slot", type=int, default=0, help="slot number (0: .coli_kv, i: .coli_kv.i)")
    exp.add_argument("--root", required=True, help="the session store directory")
    exp.add_argument("--force", action="store_true", help="export even if MODEL_DIR holds another model")
    exp.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    exp.set_defaults(func=run_export)


def run_import(args: argparse.Namespace) -> int:
    store = SessionStore(args.root)
    info = import_slot(store, args.model_dir, slot=args.slot, session_id=args.session_id,
                       replace=args.replace)
    print(f"imported slot {args.slot} of {args.model_dir} as session {info.id} ({info.tokens} records)")
    if args.json:
        print(json.dumps({"imported": info.to_json(), "slot": args.slot}, sort_keys=True))
    return 0


def run_export(args: argparse.Namespace) -> int:
    store = SessionStore(args.root, create=False)
    path = export_slot(store, args.session_id, args.model_dir, slot=args.slot, force=args.force)
    info = store.info(args.session_id)
    print(f"exported session {args.session_id} ({info.tokens} records) to {path}")
    if args.json:
        print(json.dumps({"exported": args.session_id, "path": str(path), "tokens": info.tokens,
                          "slot": args.slot}, sort_keys=True))
    return 0


__all__ = ["register", "run_export", "run_import"]
