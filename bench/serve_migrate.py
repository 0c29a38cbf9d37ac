"""Where a host-to-host bundle move's seconds go: bench/serve.py's figure 4 cut into its pieces.

    python -m bench.serve_migrate [--quick] [--json] [--dir DIR] [--tokens N] [--reps N]

On one GLM-5.2-shaped v2 session (bench.serve_session's), against two real servers A and B,
medians of ``--reps`` repetitions, every piece alternated with the baseline in the same loop:

- ``durable_copy_s``: ``cp -r`` of the session's files + fsync of each and of the directory;
- ``get_s``: A's ``GET /v1/sessions/ID/bundle`` alone, read and dropped (one raw socket);
- ``put_s``: B's ``PUT`` alone, its body a bundle file sent with ``sendfile``;
  (before each PUT and pipe B's copy of the session is deleted, untimed, as in bench/serve.py)
- ``pipe_s``: the move, A's GET spliced into B's PUT (bench.serve_pipe, no user-space copy);
- ``pipe_copy_s``: the same through one user-space buffer (``recv_into`` + ``sendall``);
- ``pipe_httpx_s``: the same through one httpx client (1 MiB pieces; the earlier bench's pipe);
- ``export_s`` / ``import_s``: the server's two halves in this process, no HTTP: the export
  written to a null sink, the import of the bundle file (verified and installed).

Each ratio printed is ``durable_copy_s / piece``: above 1 the piece alone is faster than the copy.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

import httpx

from bench.report import add_json_flag, json_line
from bench.serve_pipe import get_bundle, httpx_pipe, pipe_bundle, put_bundle
from bench.serve_procs import Server
from bench.serve_session import SESSION, bench_migrate, build, durable_copy, write_glm_cache_checkpoint
from sessionstore.migration import export_session, import_bundle
from sessionstore.sessions import SessionStore


class NullSink(io.RawIOBase):
    """A writable file that drops its bytes."""

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return len(b)


def in_process(root: Path, bundle: Path) -> dict[str, float]:
    """The export (to nothing) and the import (of ``bundle``, then deleted), no HTTP."""
    src, dst = SessionStore(root / "a"), SessionStore(root / "c")
    t0 = time.perf_counter()
    export_session(src, SESSION, cast(BinaryIO, NullSink()), compression="none")
    t1 = time.perf_counter()
    with open(bundle, "rb") as f:
        import_bundle(dst, f, replace=True)
    t2 = time.perf_counter()
    shutil.rmtree(dst.session_dir(SESSION))
    return {"export_s": t1 - t0, "import_s": t2 - t1}


def run(root: Path, tokens: int, reps: int, with_httpx: bool) -> dict[str, Any]:
    model_dir = write_glm_cache_checkpoint(root / "glm-5.2-shaped")
    s = build(root / "a", model_dir, tokens)
    files = sum(os.path.getsize(s.directory / n) for n in os.listdir(s.directory))
    bundle = root / "glm.colibundle"
    times: dict[str, list[float]] = {}

    def timed(key: str, fn: Callable[[], float], into: Server | None = None) -> None:
        if into is not None and httpx.get(f"{into.url}/v1/sessions/{SESSION}", timeout=60).status_code == 200:
            into.call("DELETE", f"/v1/sessions/{SESSION}")  # untimed: B holds no copy beforehand
        times.setdefault(key, []).append(fn())

    with Server(root / "a", str(model_dir)) as a, Server(root / "b", str(model_dir)) as b:
        get_bundle(a.url, SESSION, str(bundle))
        size = os.path.getsize(bundle)
        for _ in range(reps):
            timed("durable_copy_s", lambda: durable_copy(s.directory, root / "copy"))
            timed("get_s", lambda: get_bundle(a.url, SESSION)[0])
            timed("put_s", lambda: put_bundle(b.url, SESSION, str(bundle))[0], b)
            timed("pipe_s", lambda: pipe_bundle(a.url, b.url, SESSION)[0], b)
            timed("pipe_copy_s", lambda: pipe_bundle(a.url, b.url, SESSION, splice=False)[0], b)
            if with_httpx:
                timed("pipe_httpx_s", lambda: httpx_pipe(a.url, b.url, SESSION)[0], b)
    for _ in range(reps):
        for key, value in in_process(root, bundle).items():
            times.setdefault(key, []).append(value)
    res: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    res.update(session_bytes=files, bundle_bytes=size, tokens=tokens, reps=reps,
               all={k: [round(x, 3) for x in v] for k, v in times.items()})
    return res


FIGURE_KEYS = ("http_migrate_vs_durable_copy", "http_migrate_s", "durable_copy_s", "session_bytes", "bundle_bytes",
               "http_migrate_gb_s", "durable_copy_gb_s", "http_migrate_all_s", "durable_copy_all_s",
               "http_migrate_pipe_vs_durable_copy", "http_migrate_pipe_s", "http_migrate_pipe_all_s")


def run_figure(root: Path, tokens: int, reps: int) -> dict[str, Any]:
    """bench/serve.py's figure 4 alone (``--only migrate``): its session, its two servers."""
    model_dir = write_glm_cache_checkpoint(root / "glm-5.2-shaped")
    directory = build(root / "a", model_dir, tokens).directory
    with Server(root / "a", str(model_dir)) as a, Server(root / "b", str(model_dir), "--pull-from", a.url) as b:
        return bench_migrate(a, b, directory, root, reps)


def report_figure(res: dict[str, Any]) -> None:
    ms = 1e3
    print(f"  http_migrate_vs_durable_copy {res['http_migrate_vs_durable_copy']:.3f}  B pulls from A over HTTP "
          f"{res['http_migrate_s'] * ms:.0f} ms ({res['http_migrate_gb_s']:.2f} GB/s, bundle "
          f"{res['bundle_bytes'] / 2**20:.0f} MiB) vs cp -r + fsync {res['durable_copy_s'] * ms:.0f} ms "
          f"({res['durable_copy_gb_s']:.2f} GB/s) of {res['session_bytes'] / 2**20:.0f} MiB; each rep: "
          f"{[round(x, 3) for x in res['http_migrate_all_s']]} vs {[round(x, 3) for x in res['durable_copy_all_s']]}")
    print(f"    a client piping A's GET into B's PUT instead: {res['http_migrate_pipe_vs_durable_copy']:.3f} "
          f"({res['http_migrate_pipe_s'] * ms:.0f} ms; each rep "
          f"{[round(x, 3) for x in res['http_migrate_pipe_all_s']]})")


def report(res: dict[str, Any]) -> None:
    base = res["durable_copy_s"]
    print(f"bench.serve_migrate: {res['tokens']} tokens, session {res['session_bytes'] / 2**20:.0f} MiB, "
          f"bundle {res['bundle_bytes'] / 2**20:.0f} MiB; {res['reps']} reps, medians")
    for key in ("durable_copy_s", "get_s", "put_s", "pipe_s", "pipe_copy_s", "pipe_httpx_s", "export_s",
                "import_s"):
        if key in res:
            print(f"  {key:16s} {res[key] * 1e3:8.0f} ms  {res['session_bytes'] / res[key] / 1e9:5.2f} GB/s  "
                  f"copy/this {base / res[key]:5.2f}   {res['all'][key]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 2,048-token session, 2 reps")
    add_json_flag(ap)
    ap.add_argument("--dir", default=None, help="where the stores go (a real disk)")
    ap.add_argument("--tokens", type=int, default=None, help="committed tokens of the session")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each piece")
    ap.add_argument("--no-httpx", action="store_true", help="skip the httpx pipe")
    args = ap.parse_args(argv)
    tokens = args.tokens or (2048 if args.quick else 32768)
    reps = args.reps or (2 if args.quick else 3)
    if tokens < 2 or reps < 1:
        ap.error("--tokens must be >= 2, --reps >= 1")
    root = Path(tempfile.mkdtemp(prefix="coli-bench-migrate-", dir=args.dir))
    try:
        res = run(root, tokens, reps, not args.no_httpx)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(res)
    return json_line(res, args.json, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
