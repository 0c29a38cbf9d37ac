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
import signal
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
from bench.object_read import raw_read
from bench.report import json_line
from sessionstore.sessions.catalogue import RACY_S
from sessionstore.sessions.store import SessionStore

GOALS = {"restore_offloaded_over_raw_read": 2.0, "ready_s_100k_over_100": 1.5,
         "first_request_100k_over_100": 1.2,
         "turn_ship_bytes_over_turn_records": 1.5}  # key -> the most it may be
SERVER_SIZES = (100, 100_000)  # the stores a real server is timed on (--quick: 100 / 2,000)
QUICK_SERVER_SIZES = (100, 2_000)
PAGE_LIMIT = 20  # sessions per listed page (OpenAI's default)
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "scale-bench"


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
        from sessionstore.service.engine import EngineMetrics

        self.store, self.home = store, home
        self.metrics = EngineMetrics()
        self.last_use: dict[str, float] = {}

    def forget(self, session_id: str) -> None:
        pass  # nothing is open: the bench's session is suspended

    def claim(self, session_id: str) -> None:
        pass

    def release(self, session_id: str | None) -> None:
        pass


def measure_restore(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``restore_offloaded_over_raw_read``: see the module."""
    with loopback_s3() as bucket_url:
        return restore_on(args, work, bucket_url)


def restore_on(args: argparse.Namespace, work: Path, bucket_url: str) -> dict[str, Any]:
    """``restore_offloaded_over_raw_read`` on the S3 server of ``bucket_url`` (the AWS environment
    pointing at it)."""
    from sessionstore.migration import RemoteStore
    from sessionstore.service.engine import TierManager
    from sessionstore.service.fleet import FleetHome
    from sessionstore.sessions import SessionStore
    from sessionstore.sessions.tier_record import read_tier

    tokens = 256 if args.quick else 2048
    store = SessionStore(work / "host")
    build_session(store, "s", tokens)
    kv_bytes = os.path.getsize(store.kv_path("s"))
    remote = RemoteStore(store, f"{bucket_url}/restore", host_id="bench-host")
    manager = TierManager(_Engine(store, FleetHome(remote)))
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


class TimedServer:
    """A real ``coli-kv serve --http`` (the tiny model) on one store, for the server's keys."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def start(self) -> float:
        """Start it; seconds from the spawn until ``/healthz`` answers 200 (the engine core up)."""
        import httpx

        t0 = time.perf_counter()
        env = {**os.environ, "COLI_LOG": "off"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tools", "serve", "--http", "127.0.0.1:0", "--root",
                                      str(self.root), "--model", "tiny"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        assert self.proc.stdout is not None
        self.url = json.loads(self.proc.stdout.readline())["url"]
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=5).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode})")
            time.sleep(0.01)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def measure_server_scale(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``ready_s_100k_over_100``, ``list_page_ms_100k``, ``first_request_100k_over_100``: a real
    server on stores of 100 and 100,000 sessions (bench.catalogue's stores: one small tiny-model
    session, hard-linked; the catalogue built once before, as a server that ran before leaves it):
    the time from its spawn to ready, a page of the listing (a middle one: ``after`` an id half way),
    and the first request on a suspended session (a one-token completion continuing its history:
    resume, verify, one step, commit). Medians of ``--reps`` server starts per size.

    Both stores are built first and flushed to the disk (``os.sync``: the build's dirty pages and
    journal must not be written back during one size's timings), each catalogue is made ``RACY_S``
    after its last directory so that its stamp is trusted (no server reconciles), and the sizes
    alternate within every rep: a load that comes and goes on a shared machine falls on both
    sizes alike instead of on one block of reps."""
    from bench.catalogue import build_store, make_template

    sizes = QUICK_SERVER_SIZES if args.quick else SERVER_SIZES
    template = make_template(work / "template")
    probes = {n: [n // 3 + r for r in range(args.reps)] for n in sizes}
    roots = {n: work / f"store-{n}" for n in sizes}
    for n in sizes:
        build_store(roots[n], template, n, set(probes[n]))
    time.sleep(RACY_S + 0.1)  # a catalogue stamped now vouches for the directories (FORMAT.md 5.9)
    for n in sizes:
        SessionStore(roots[n]).catalogue.count()  # made once (the directories came behind its back)
        opened = SessionStore(roots[n]).catalogue.opened
        assert opened == "fresh", f"store of {n}: catalogue {opened} on the second open"
    os.sync()
    samples: dict[int, dict[str, list[float]]] = {
        n: {"ready_s": [], "list_page_s": [], "first_request_s": []} for n in sizes}
    for r in range(args.reps):
        for n in sizes:
            sample_server(roots[n], n, probes[n][r], samples[n])
    found = {n: {k: statistics.median(v) for k, v in samples[n].items()} for n in sizes}
    small, large = found[sizes[0]], found[sizes[-1]]
    return {"server_sizes": list(sizes),
            "ready_s_100k_over_100": large["ready_s"] / small["ready_s"],
            "first_request_100k_over_100": large["first_request_s"] / small["first_request_s"],
            "list_page_ms_100k": large["list_page_s"] * 1e3,
            "server_results": {str(n): v for n, v in found.items()},
            "first_request_samples_ms": {str(n): [round(t * 1e3, 1) for t in samples[n]["first_request_s"]]
                                         for n in sizes}}


def sample_server(root: Path, n: int, probe: int, samples: dict[str, list[float]]) -> None:
    """One server start on the store of ``n`` sessions at ``root``: its time to ready, five middle
    pages over one kept-alive connection, then the first request on the suspended session ``probe``."""
    import httpx

    from bench.catalogue import TEMPLATE_PROMPT, sid_of

    server = TimedServer(root)
    samples["ready_s"].append(server.start())
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:  # one connection, kept alive
            for _ in range(5):
                t = time.perf_counter()
                page = client.get(f"/v1/sessions?limit={PAGE_LIMIT}&after={sid_of(n // 2)}").json()
                samples["list_page_s"].append(time.perf_counter() - t)
                assert page["data"][0]["id"] == sid_of(n // 2 + 1), page["data"][:1]
            body = {"model": "tiny", "prompt": [*TEMPLATE_PROMPT, 7], "max_tokens": 1, "session": sid_of(probe)}
            t = time.perf_counter()
            reply = client.post("/v1/completions", json=body)
            samples["first_request_s"].append(time.perf_counter() - t)
            assert reply.status_code == 200, reply.text
            assert reply.json()["session"]["reused_prefix"] == len(TEMPLATE_PROMPT)
    finally:
        server.stop()


# key -> (the function that measures it and its companions); other parts of issue 25 add theirs here
def measure_ship(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``turn_ship_bytes_over_turn_records`` and ``takeover_s``: :mod:`bench.ship_measure`."""
    from bench.ship_measure import measure_shipping

    with loopback_s3() as bucket_url:
        return measure_shipping(args, work, bucket_url)


MEASURES: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "restore_offloaded_over_raw_read": measure_restore,
    "server_scale": measure_server_scale,
    "shipping": measure_ship,
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
    if "server_results" in out:
        for n, v in out["server_results"].items():
            print(f"  {n} sessions: ready {v['ready_s']:.2f} s, a middle page {v['list_page_s'] * 1e3:.1f} ms, "
                  f"the first request on a suspended session {v['first_request_s'] * 1e3:.1f} ms "
                  f"(each start: {out['first_request_samples_ms'][n]})")
        print(f"list_page_ms_100k: {out['list_page_ms_100k']:.1f} ms (at {out['server_sizes'][-1]} sessions)")
    if "restore_offloaded_s" in out:
        print(f"  restore {out['restore_offloaded_s'] * 1e3:.1f} ms vs raw read {out['raw_read_s'] * 1e3:.1f} ms of a "
              f"{out['restore_bundle_bytes'] / 1e6:.1f} MB bundle ({out['restore_tokens']} tokens, "
              f"{out['restore_kv_bytes'] / 1e6:.1f} MB kv file)")
    return json_line(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
