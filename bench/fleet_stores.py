"""The fleet's figures on a real S3 server (SeaweedFS, ``weed mini``) beside moto, in one run
(issue 38 part 4): ``python -m bench.fleet_stores [--quick] [--reps N] --json``.

For each store, started on loopback by this bench (moto in a process of its own, SeaweedFS through
``tools/_seaweed.py``), with the AWS environment pointing at it while it is measured:

- per-turn shipped bytes over the turn's records, an append (``turn_ship_bytes_over_turn_records``)
  and a cut (``cut_shipped_bytes_ratio``), with their whole-bundle baselines, and ``takeover_s``
  (a host stops renewing as if SIGKILLed; the other waits out the TTL, takes the lease, claims the
  head, fetches and installs the chain): :func:`bench.ship_measure.measure_shipping`;
- ``restore_offloaded_over_raw_read``: :func:`bench.scale.restore_on`;
- lease latency: ``lease_acquire_ms`` (the conditional create of a new session's lease,
  ``If-None-Match: *``, read back), ``lease_renew_ms`` (its ``If-Match`` replace) and
  ``lease_release_ms``, medians over ``LEASES`` sessions per rep.

Medians of ``--reps`` rounds per store; the stores run one after the other (each owns the AWS
environment while it runs), moto first. ``seaweedfs_over_moto`` holds SeaweedFS's figure over moto's
for every time key.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from bench.report import json_line

LEASES = 20  # sessions whose lease is taken, renewed and released per rep
BUCKET = "fleet-bench"
TIME_KEYS = ("turn_ship_s", "takeover_s", "takeover_fetch_s", "restore_offloaded_s", "raw_read_s",
             "lease_acquire_ms", "lease_renew_ms", "lease_release_ms")


@contextlib.contextmanager
def seaweed_s3(work: Path) -> Iterator[str]:
    """A SeaweedFS S3 server on loopback with a bucket, the AWS environment pointed at it while
    the block runs; yields the bucket's ``s3://`` URL. Stopped and removed after."""
    import s3fs

    from tools._seaweed import client_env, start_seaweed

    server = start_seaweed(work / "seaweedfs")
    env = client_env(server.endpoint)
    try:
        with mock.patch.dict(os.environ, env):  # the whole environment restored after
            os.environ.pop("AWS_SESSION_TOKEN", None)
            s3fs.S3FileSystem.clear_instance_cache()
            s3fs.S3FileSystem().mkdir(BUCKET)
            yield f"s3://{BUCKET}"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def measure_leases(args: argparse.Namespace, work: Path, bucket_url: str) -> dict[str, Any]:
    """``lease_acquire_ms``, ``lease_renew_ms``, ``lease_release_ms``: see the module."""
    from sessionstore.migration import RemoteStore
    from sessionstore.sessions import SessionStore

    remote = RemoteStore(SessionStore(work / "leases"), f"{bucket_url}/leases", host_id="bench-host")
    acquire, renew, release = [], [], []
    for rep in range(args.reps):
        for i in range(LEASES):
            sid = f"r{rep}-s{i}"
            t0 = time.perf_counter()
            remote.acquire(sid)
            t1 = time.perf_counter()
            remote.renew(sid)
            t2 = time.perf_counter()
            remote.release(sid)
            t3 = time.perf_counter()
            acquire.append((t1 - t0) * 1e3)
            renew.append((t2 - t1) * 1e3)
            release.append((t3 - t2) * 1e3)
    return {"lease_acquire_ms": statistics.median(acquire), "lease_renew_ms": statistics.median(renew),
            "lease_release_ms": statistics.median(release), "lease_samples": len(acquire)}


def measure_store(args: argparse.Namespace, work: Path, bucket_url: str) -> dict[str, Any]:
    """Every figure of the module on one store."""
    from bench.scale import restore_on
    from bench.ship_measure import measure_shipping

    out: dict[str, Any] = {}
    for name, measure in (("shipping", measure_shipping), ("restore", restore_on), ("leases", measure_leases)):
        (work / name).mkdir()
        out.update(measure(args, work / name, bucket_url))
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.scale import loopback_s3

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sessions")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per figure (median)")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    out: dict[str, Any] = {"reps": args.reps, "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="coli-fleet-stores-") as tmp:
        work = Path(tmp)
        (work / "moto").mkdir()
        with loopback_s3() as url:
            out["moto"] = measure_store(args, work / "moto", url)
        (work / "seaweedfs").mkdir()
        with seaweed_s3(work) as url:
            (work / "sw").mkdir()
            out["seaweedfs"] = measure_store(args, work / "sw", url)
    out["seaweedfs_over_moto"] = {k: out["seaweedfs"][k] / out["moto"][k] for k in TIME_KEYS}
    for store in ("moto", "seaweedfs"):
        r = out[store]
        print(f"{store}: append {r['turn_ship_bytes_over_turn_records']:.3f} x its records "
              f"(bundle {r['turn_ship_baseline_bundle_over_turn_records']:.1f} x), cut "
              f"{r['cut_shipped_bytes_ratio']:.3f} x (bundle {r['cut_baseline_bundle_over_turn_records']:.1f} x), "
              f"takeover {r['takeover_s']:.2f} s (TTL {r['takeover_lease_ttl_s']} s + fetch "
              f"{r['takeover_fetch_s']:.2f} s), restore {r['restore_offloaded_over_raw_read']:.2f} x raw read, "
              f"lease acquire {r['lease_acquire_ms']:.1f} ms, renew {r['lease_renew_ms']:.1f} ms")
    return json_line(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
