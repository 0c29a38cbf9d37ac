"""The object-store tier on a real S3 server (SeaweedFS, the run's one, tests/conftest.py) beside
moto: where the two answer differently (FORMAT.md 6.4, "What stores answer"), the tier's outcome
is the same on both; and a lease race between many host processes on the real store."""
from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernels.errors import LockedError
from sessionstore.migration.remote import RemoteStore
from sessionstore.sessions.store import SessionStore
from tests.support.lease_race import race_host
from tests.support.migrate import start_s3_server
from tools._seaweed import ACCESS_KEY, SECRET_KEY

HOSTS = 8
ROUNDS = 3


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    server, endpoint = start_s3_server()
    try:
        yield endpoint
    finally:
        server.stop()


_serial = iter(range(1, 1 << 30))


@pytest.fixture(params=["moto", "seaweedfs"])
def store_url(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """(s3://bucket/prefix, storage options) of a fresh bucket on moto or on SeaweedFS; the
    endpoint travels as storage options, so both stores can be named in one run."""
    if request.param == "moto":
        import boto3

        endpoint = request.getfixturevalue("moto_endpoint")
        bucket = f"moto-{next(_serial):05d}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                     region_name="us-east-1").create_bucket(Bucket=bucket)
    else:
        endpoint = request.getfixturevalue("seaweed").endpoint
        bucket = request.getfixturevalue("seaweed_buckets").take()
    options = {"endpoint_url": endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}
    return f"s3://{bucket}/real", options


def host(tmp_path: Path, store_url: tuple[str, dict[str, Any]], name: str, **kw: Any) -> RemoteStore:
    url, options = store_url
    return RemoteStore(SessionStore(tmp_path / name), url, host_id=name, storage_options=options, **kw)


def test_a_lease_already_deleted_is_forgotten_quietly(tmp_path, store_url) -> None:
    """Two hosts clearing one bundle-less lease: the second delete (If-Match) finds nothing. AWS
    and moto answer 404, SeaweedFS 412; either way the lease is gone, which is what was asked."""
    a, b = host(tmp_path, store_url, "host-a"), host(tmp_path, store_url, "host-b", lease_ttl=0.3)
    held = b.acquire("conv")
    time.sleep(0.4)  # b's first push never landed and its lease expired: anyone may clear it
    assert a.release("conv") is None
    b.leases.forget(held)  # b's own late clean-up: quiet, not "another host changed its lease"
    assert a.lease("conv") is None


def test_a_replace_of_a_deleted_lease_is_lost_not_a_store_failure(tmp_path, store_url) -> None:
    """A conditional replace (If-Match) of a lease another host deleted meanwhile: 404 on moto,
    412 on SeaweedFS; both are the same refusal, a LockedError, never a RemoteStoreError."""
    a = host(tmp_path, store_url, "host-a")
    held = a.acquire("conv")
    a.leases.forget(held)
    with pytest.raises(LockedError, match="another host changed its lease"):
        a.leases.write(held.updated(expires_at=held.expires_at + 60), expect=held, what="renewing the lease")
    assert a.lease("conv") is None


def test_overwrites_read_back_at_once_with_the_etag_the_write_answered(tmp_path, store_url) -> None:
    """Read-after-overwrite: every renewal is what the next read returns, under the ETag its write
    answered (quoted, the same form in both answers); a stale ETag is refused."""
    a = host(tmp_path, store_url, "host-a")
    first = held = a.acquire("conv")
    for _ in range(10):
        held = a.renew("conv")
        now = a.lease("conv")
        assert now == held and now.etag == held.etag
        assert held.etag.startswith('"') and held.etag.endswith('"')
    with pytest.raises(LockedError):
        a.leases.write(first.updated(expires_at=first.expires_at + 60), expect=first, what="renewing the lease")
    assert a.lease("conv") == held


def test_leases_are_listed_in_session_id_order(tmp_path, store_url) -> None:
    a = host(tmp_path, store_url, "host-a")
    ids = ["b", "a.b", "a", "a_b", "a-b", "ab"]
    for sid in ids:
        a.acquire(sid)
    assert [lease.session_id for lease in a.list()] == sorted(ids)


def test_many_hosts_race_for_one_lease_and_exactly_one_wins(tmp_path, s3_bucket) -> None:
    """Eight host processes take one new session's lease at the same moment, in several rounds:
    exactly one wins and creates and pushes it; every other is told that host holds it, and
    nothing of theirs is on the store or on their disk."""
    url = s3_bucket.url("race")
    sids = [f"conv-{rnd}" for rnd in range(ROUNDS)]
    ctx = multiprocessing.get_context("fork")  # the hosts start with this process's imports
    barrier, answers = ctx.Barrier(HOSTS), ctx.Queue()
    procs = [ctx.Process(target=race_host, args=(url, tmp_path / f"h{i}", f"host-{i}", sids, barrier, answers))
             for i in range(HOSTS)]
    for proc in procs:
        proc.start()
    reader = RemoteStore(SessionStore(tmp_path / "reader"), url, host_id="reader")
    try:
        for sid in sids:
            got = dict(answers.get(timeout=60) for _ in range(HOSTS))
            winners = [h for h, answer in got.items() if answer["won"]]
            assert len(winners) == 1, got
            owner = winners[0]
            for h, answer in got.items():
                if h == owner:
                    assert answer["local"] and answer["generation"] == 1
                    continue
                assert answer["kind"] == "HeldElsewhereError", answer
                assert f"held live by host {owner!r}" in answer["error"], answer
                assert not answer["local"], answer  # a loser created nothing
            lease = reader.lease(sid)
            assert lease is not None and lease.owner == owner and lease.generation == 1 and lease.live()
            bundles = reader.fs.find(f"{reader.bucket}/{reader.prefix}/bundles/{sid}")
            assert [f"{reader.bucket}/{lease.bundle}"] == bundles  # the winner's push alone
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0] * HOSTS


def test_the_runs_server_holds_more_buckets_than_its_disk_has_free_gigabytes(seaweed, seaweed_buckets) -> None:
    """``weed mini`` sizes its volume count by default as free disk / volume size (1 GiB in mini),
    and every bucket is a collection with a volume of its own: on a CI disk with 33 GiB free the
    34th bucket's writes failed with "no free volumes left" (a 500 to every client). The server
    is started with its own volume count and size; more buckets than free GiB all take writes."""
    import shutil

    free_gib = shutil.disk_usage(seaweed.root).free >> 30
    client = seaweed.client()
    for _ in range(min(free_gib + 8, 600)):
        bucket = seaweed_buckets.take()
        client.put_object(Bucket=bucket, Key="lease/one", Body=b"held")
        assert client.get_object(Bucket=bucket, Key="lease/one")["Body"].read() == b"held"
