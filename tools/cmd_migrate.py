"""``coli-kv export|import|push|pull|lease``: move sessions between hosts as verified bundles.

- ``export --root R ID DEST``: DEST is a path (a directory gets ``<ID>.colibundle``), ``-``
  (stdout), an fsspec URL (``s3://bucket/key``, ``file://...``) or a ``coli-kv serve --http``
  server, ``http(s)://HOST:PORT`` (installed as ID there; ``.../NEW_ID`` names another id),
  streamed into ``PUT /v1/sessions/ID/bundle`` (``--replace`` swaps out the server's session).
- ``import --root R SRC [--replace] [--model DIR|tiny] [--as NEW_ID]``: SRC likewise (``-`` =
  stdin; ``http(s)://HOST:PORT/ID`` streams ``GET /v1/sessions/ID/bundle``). Any failure: one
  line on stderr, non-zero exit, the store unchanged.
- ``push|pull --root R --remote s3://bucket/prefix ID``: the object-store tier with its lease;
  ``lease --remote URL [ID] [--release|--renew]`` shows or changes leases.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kernels.errors import FormatError
from sessionstore.migration import (
    DEFAULT_CHUNK_BYTES,
    LEASE_TTL_S,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    HttpOptions,
    MigrateResult,
    RemoteStore,
    describe,
    export_session,
    import_bundle,
    is_http,
    is_url,
    open_sink,
    open_source,
    with_session,
)
from sessionstore.service import API_KEY_ENV
from sessionstore.sessions import SessionStore
from tools._common import fresh_store

BUNDLE_SUFFIX = ".colibundle"


def _compression(value: str) -> str | int:
    if value in ("auto", "none"):
        return value
    try:
        level = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("expected auto, none or a zstd level 1..22") from None
    if not 1 <= level <= 22:
        raise argparse.ArgumentTypeError("zstd level must be 1..22")
    return level


def _chunk_mib(value: str) -> int:
    try:
        mib = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, found {value!r}") from None
    size = mib * (1 << 20)
    if not MIN_CHUNK_BYTES <= size <= MAX_CHUNK_BYTES:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"chunk size must be {MIN_CHUNK_BYTES >> 10} KiB..16 MiB")
    return int(size)


def _remote_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remote", default=os.environ.get("COLI_REMOTE"),
                   help="s3://bucket/prefix (default: $COLI_REMOTE); endpoint and credentials "
                        "from the AWS environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)")
    p.add_argument("--host-id", default=None, help="who holds leases (default: $COLI_HOST_ID or hostname)")
    p.add_argument("--lease-ttl", type=float, default=LEASE_TTL_S, help="lease lifetime in seconds")


def _http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=None,
                   help=f"http(s)://: the server's key, sent as a bearer token (default: ${API_KEY_ENV})")
    p.add_argument("--timeout", type=float, default=HttpOptions.timeout_s,
                   help="http(s)://: the longest silence tolerated, in seconds (default %(default)s)")


def _http_options(args: argparse.Namespace) -> HttpOptions:
    if not args.timeout > 0:  # also refuses nan
        raise FormatError("--timeout must be a positive number of seconds")
    return HttpOptions(api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, timeout_s=args.timeout)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("export", help="write a session (its last commit) as a migration bundle")
    p.add_argument("--root", required=True, help="session store directory")
    p.add_argument("id", help="session id")
    p.add_argument("dest", help="bundle path or directory, '-' for stdout, a URL (s3://...), or a server "
                                "(http(s)://HOST:PORT[/NEW_ID])")
    p.add_argument("--compress", type=_compression, default="auto",
                   help="auto (zstd only while it pays, measured), none, or a zstd level 1..22")
    p.add_argument("--chunk-mib", type=_chunk_mib, default=DEFAULT_CHUNK_BYTES,
                   help="raw bytes per chunk in MiB (default 4)")
    p.add_argument("--force", action="store_true", help="overwrite an existing bundle")
    p.add_argument("--replace", action="store_true",
                   help="http(s)://: swap out the server's (suspended) session of that id")
    _http_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run_export)

    p = subparsers.add_parser("import", help="verify a bundle and install it as a session")
    p.add_argument("--root", required=True, help="session store directory")
    p.add_argument("src", help="bundle path, '-' for stdin, a URL (s3://...), or a server's session "
                               "(http(s)://HOST:PORT/ID)")
    p.add_argument("--replace", action="store_true", help="swap out an existing session of that id")
    p.add_argument("--model", default=None, help="refuse the bundle unless it belongs to this "
                                                 "model (checkpoint dir or 'tiny')")
    p.add_argument("--as", dest="as_id", default=None, help="install under another session id")
    _http_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run_import)

    p = subparsers.add_parser("push", help="upload a suspended session to the remote and release it")
    p.add_argument("--root", required=True, help="session store directory")
    p.add_argument("id", help="session id")
    _remote_args(p)
    p.add_argument("--keep-lease", action="store_true", help="keep holding the session (no release)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run_push)

    p = subparsers.add_parser("pull", help="take a session's lease on the remote and import it")
    p.add_argument("--root", required=True, help="session store directory")
    p.add_argument("id", help="session id")
    _remote_args(p)
    p.add_argument("--replace", action="store_true", help="swap out the local copy")
    p.add_argument("--model", default=None, help="refuse unless it belongs to this model")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run_pull)

    p = subparsers.add_parser("lease", help="show (or release/renew) sessions' leases on the remote")
    p.add_argument("--root", required=True, help="session store directory")
    p.add_argument("id", nargs="?", default=None, help="session id (default: list every lease)")
    _remote_args(p)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--release", action="store_true",
                       help="release this host's lease (one that never pointed at a bundle is "
                            "deleted; any host may clear it once it expired)")
    group.add_argument("--renew", action="store_true", help="extend this host's lease")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run_lease)


def _summary(verb: str, r: MigrateResult, where: str) -> str:
    return (f"{verb} session {r.session_id} ({r.tokens} tokens, {r.kv_dtype}) {where}: "
            f"{r.raw_bytes} bytes as {r.stored_bytes} ({r.ratio:.3f}x, {r.zstd_chunks}/{r.chunks} "
            f"chunks zstd) in {r.seconds:.2f} s")


def run_export(args: argparse.Namespace) -> int:
    if args.dest == "-" and args.json:
        raise FormatError("export to '-' writes the bundle on stdout: --json cannot share it")
    store = SessionStore(args.root, create=False)
    dest = args.dest
    if is_http(dest):
        if args.force:
            raise FormatError("--force is for bundle files; give --replace to swap out the server's session")
        dest = with_session(dest, args.id)
    elif args.replace:
        raise FormatError("--replace is for http(s):// servers; give --force to overwrite a bundle file")
    if dest != "-" and not is_url(dest) and os.path.isdir(dest):
        dest = os.path.join(dest, args.id + BUNDLE_SUFFIX)
    with open_sink(dest, overwrite=args.force or args.replace, http=_http_options(args)) as (sink, info):
        result = export_session(store, args.id, sink, compression=args.compress,
                                chunk_bytes=args.chunk_mib, progress=True)
    if info.reply is not None:
        dest = info.target
    line = _summary("exported", result, f"to {describe(dest)}")
    if dest == "-":
        print(line, file=sys.stderr)
        return 0
    print(line)
    if args.json:
        server = {} if info.reply is None else {"server": info.reply}
        print(json.dumps({**result.to_json(), "dest": dest, **server}))
    return 0


def run_import(args: argparse.Namespace) -> int:
    with fresh_store(args.root) as store, open_source(args.src, http=_http_options(args)) as source:
        result = import_bundle(store, source, source_name=describe(args.src),
                               replace=args.replace, model=args.model, as_id=args.as_id,
                               progress=True)
    print(_summary("imported", result, f"from {describe(args.src)} into {store.root}"))
    if args.json:
        print(json.dumps({**result.to_json(), "root": str(store.root)}))
    return 0


def _remote(args: argparse.Namespace, store: SessionStore) -> RemoteStore:
    return RemoteStore(store, args.remote, host_id=args.host_id, lease_ttl=args.lease_ttl)


def _need_remote(args: argparse.Namespace) -> None:
    if not args.remote:
        raise FormatError("no remote: give --remote s3://bucket/prefix or set COLI_REMOTE")


def run_push(args: argparse.Namespace) -> int:
    _need_remote(args)
    remote = _remote(args, SessionStore(args.root, create=False))
    result, lease = remote.push(args.id, release=not args.keep_lease)
    state = "released" if lease.released else f"held by {lease.owner}"
    print(_summary("pushed", result, f"to {remote.url}") + f"; lease {state}")
    if args.json:
        print(json.dumps({**result.to_json(), "lease": lease.to_json()}))
    return 0


def run_pull(args: argparse.Namespace) -> int:
    _need_remote(args)
    with fresh_store(args.root) as store:
        remote = _remote(args, store)
        result, lease = remote.pull(args.id, replace=args.replace, model=args.model)
    print(_summary("pulled", result, f"from {remote.url}") + f"; lease held by {lease.owner} "
          f"(generation {lease.generation})")
    if args.json:
        print(json.dumps({**result.to_json(), "lease": lease.to_json()}))
    return 0


def run_lease(args: argparse.Namespace) -> int:
    _need_remote(args)
    if args.id is None and (args.release or args.renew):
        raise FormatError("--release/--renew need a session id")
    with fresh_store(args.root, keep_on_success=False) as store:  # leases live on the remote only
        remote = _remote(args, store)
        if args.id is None:
            leases = remote.list()
        elif args.release:
            released = remote.release(args.id)
            if released is None:  # it never pointed at a bundle: deleted, nothing stays
                print(f"{args.id}: lease deleted (no bundle was ever pushed)")
                if args.json:
                    print(json.dumps({"leases": [], "deleted": args.id}))
                return 0
            leases = [released]
        elif args.renew:
            leases = [remote.renew(args.id)]
        else:
            lease = remote.lease(args.id)
            leases = [] if lease is None else [lease]
    if not leases:
        print(f"no lease for session {args.id!r} on {remote.url}" if args.id else f"no leases on {remote.url}")
    for lease in leases:
        state = "live" if lease.live() else ("released" if lease.released else "expired")
        print(f"{lease.session_id}: {state}, owner {lease.owner}, generation {lease.generation}, "
              f"bundle {lease.bundle or '-'} ({lease.bundle_tokens} tokens)")
    if args.json:
        print(json.dumps({"leases": [lease.to_json() for lease in leases]}))
    return 0
