"""The store at scale and on a fleet (issue 25): one bench, one key per figure, each measured by a
function of its own in :data:`MEASURES` (run them all, or some with ``--only KEY``).

``restore_offloaded_over_raw_read`` (goal <= 2.0): a GLM-5.2-shaped session (L=78, kv_lora 512,
rope 64, fp8; ``bench.migrate.build_session``) offloaded to an S3 API server on loopback (moto,
its own process) by the service's tier manager, then restored by it (the fleet's pull over the
offloaded stub: lease taken, bundle downloaded, decoded, every checksum verified, the session's
files written durably and installed, its tier record rewritten), versus the raw read of the same
bundle object through the same reader (``open_source``, read front to back in 4 MiB pieces and
dropped: the bytes and nothing else). Medians of
``--reps`` rounds; each round offloads again (untimed) before its restore.

``--quick``: a smaller session. ``--json``: one JSON object as the last line.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.migrate import build_session

GOALS = {"restore_offloaded_over_raw_read": 2.0}  # key -> the most it may be
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "scale-bench"
READ_PIECE = 4 << 20  # the raw read's pieces


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def loopback_s3() -> Iterator[str]:
    """A moto S3 server in a process of its own on 127.0.0.1, the AWS environment pointed at it
    and a bucket made; yields the bucket's ``s3://`` URL."""
    import s3fs

    port = _free_port()
    code = ("import logging, sys, time\nlogging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
            "from moto.server import ThreadedMotoServer\n"
            f"ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False).start()\n"
            "sys.stdin.read()\n")  # until the bench closes its stdin
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)
    saved = {k: os.environ.get(k) for k in (*S3_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.1)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(BUCKET)
        yield f"s3://{BUCKET}"
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()


class _Engine:
    """What the tier manager reads of the service's engine, for a store without a model: its
    store and fleet home, metrics, last uses; no request ever holds a session here."""

    def __init__(self, store: Any, home: Any) -> None:
        from sessionstore.service.metrics import EngineMetrics

        self.store, self.home = store, home
        self.metrics = EngineMetrics()
        self.last_use: dict[str, float] = {}

    def forget(self, session_id: str) -> None:
        pass  # nothing is open: the bench's session is suspended

    def claim(self, session_id: str) -> None:
        pass

    def release(self, session_id: str | None) -> None:
        pass


def raw_read(url: str) -> int:
    """Read the object at ``url`` front to back the way a pull reads a bundle; its bytes."""
    from sessionstore.migration import open_source

    total = 0
    with open_source(url) as src:
        while chunk := src.read(READ_PIECE):
            total += len(chunk)
    return total


def measure_restore(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``restore_offloaded_over_raw_read``: see the module."""
    from sessionstore.migration import RemoteStore
    from sessionstore.service.fleet import SessionHome
    from sessionstore.service.tiers import TierManager
    from sessionstore.sessions import SessionStore
    from sessionstore.sessions.tier_record import read_tier

    tokens = 256 if args.quick else 2048
    with loopback_s3() as bucket_url:
        store = SessionStore(work / "host")
        build_session(store, "s", tokens)
        kv_bytes = os.path.getsize(store.kv_path("s"))
        remote = RemoteStore(store, f"{bucket_url}/restore", host_id="bench-host")
        manager = TierManager(_Engine(store, SessionHome(remote)))
        restores, reads = [], []
        bundle_bytes = 0
        for _ in range(args.reps):
            if not manager.offload("s"):
                raise RuntimeError("the session was not offloaded")
            record = read_tier(store.session_dir("s"))
            assert record.offloaded is not None
            t = time.perf_counter()
            bundle_bytes = raw_read(remote.objects.url_of(record.offloaded.bundle))
            reads.append(time.perf_counter() - t)
            t = time.perf_counter()
            manager.restore("s", record)
            restores.append(time.perf_counter() - t)
            assert read_tier(store.session_dir("s")).offloaded is None
            assert store.read_manifest("s").committed == tokens
    restore_s, read_s = statistics.median(restores), statistics.median(reads)
    return {"restore_offloaded_over_raw_read": restore_s / read_s, "restore_offloaded_s": restore_s,
            "raw_read_s": read_s, "restore_tokens": tokens, "restore_kv_bytes": kv_bytes,
            "restore_bundle_bytes": bundle_bytes}


# key -> (the function that measures it and its companions); other parts of issue 25 add theirs here
MEASURES: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "restore_offloaded_over_raw_read": measure_restore,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller stores and sessions")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per figure (median)")
    ap.add_argument("--only", action="append", choices=sorted(MEASURES), help="measure only this key (repeatable)")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    out: dict[str, Any] = {"reps": args.reps, "quick": args.quick}
    for key in args.only or sorted(MEASURES):
        with tempfile.TemporaryDirectory(prefix="coli-scale-") as work:
            out.update(MEASURES[key](args, Path(work)))
    for key, goal in GOALS.items():
        if key in out:
            ok = out[key] <= goal
            out.setdefault("goals", {})[key] = {"goal": f"<= {goal}", "met": ok}
            print(f"{key}: {out[key]:.3f} (goal <= {goal}: {'met' if ok else 'NOT met'})")
    if "restore_offloaded_s" in out:
        print(f"  restore {out['restore_offloaded_s'] * 1e3:.1f} ms vs raw read {out['raw_read_s'] * 1e3:.1f} ms of a "
              f"{out['restore_bundle_bytes'] / 1e6:.1f} MB bundle ({out['restore_tokens']} tokens, "
              f"{out['restore_kv_bytes'] / 1e6:.1f} MB kv file)")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
