"""Write-through shipping (FORMAT.md 6.7) against a real S3 server (SeaweedFS, tests/conftest.py) on 127.0.0.1: each
turn ships a segment bounded by its own records; another host takes the chain over after the lease
expires and installs exactly the files of the last shipped turn; the former holder is fenced; a
damaged segment is refused and nothing is installed."""
from __future__ import annotations

import dataclasses
import time

import pytest

from kernels.errors import LockedError
from sessionstore.kvfile import KVWriter, open_kv
from sessionstore.migration.object_store import RemoteStoreError
from sessionstore.migration.remote import RemoteStore
from sessionstore.migration.shipping import TurnShipper
from sessionstore.sessions.manifest import write_manifest
from sessionstore.sessions.store import SessionStore
from tests.support.migrate import (
    SMALL_DIMS,
    make_session,
    session_files,
    stored_keys,
    synthetic_rows,
)

FIXED_BYTES = 4096  # the segment's framing, headers and small files, and the head


@pytest.fixture
def hosts(tmp_path, s3_bucket):
    url = s3_bucket.url("fleet")
    a = RemoteStore(SessionStore(tmp_path / "hostA"), url, host_id="host-a", lease_ttl=1.0)
    b = RemoteStore(SessionStore(tmp_path / "hostB"), url, host_id="host-b", lease_ttl=30.0)
    return a, b


def grow(store: SessionStore, sid: str, k: int, seed: int) -> None:
    """One 'turn': k more committed records (and the manifest that says so)."""
    manifest = store.read_manifest(sid)
    with KVWriter.open(store.kv_path(sid), SMALL_DIMS, kv_dtype=manifest.kv_dtype) as writer:
        writer.append(synthetic_rows(k, SMALL_DIMS, seed, start=manifest.committed))
        writer.commit()
    write_manifest(store.session_dir(sid) / "manifest.json",
                   dataclasses.replace(manifest, committed=manifest.committed + k))


def test_each_turn_ships_its_records_and_another_host_takes_the_chain_over(hosts):
    a, b = hosts
    make_session(a.store, "conv", 300)
    held = a.acquire("conv")
    ship_a = TurnShipper(a)
    first = ship_a.ship("conv", held)
    assert first.kind == "base" and first.nrec == 300
    for turn, k in enumerate((40, 7, 1, 25)):
        grow(a.store, "conv", k, seed=turn + 1)
        report = ship_a.ship("conv", held)
        assert report.kind == "segment" and report.nrec - report.start == k
        # O(new tokens): the turn's records, plus a fixed few KiB, never the session
        assert report.shipped_bytes <= 1.5 * report.record_bytes + FIXED_BYTES, report
        assert report.head_bytes < 1024  # the head names the last segment only: it never grows
    assert ship_a.read_head("conv").nrec == 373 and ship_a.read_head("conv").count == 4
    expected = session_files(a.store, "conv")

    time.sleep(1.1)  # host A 'dies': its lease expires
    taken = b.acquire("conv")
    ship_b = TurnShipper(b)
    assert ship_b.take_over("conv", taken, local_current=False) is True
    assert session_files(b.store, "conv") == expected  # token-exact: the very files, fetched
    head = ship_b.read_head("conv")
    assert head.owner == "host-b" and head.generation == taken.generation

    grow(a.store, "conv", 3, seed=9)  # the former holder commits once more: fenced
    with pytest.raises(LockedError, match="taken over"):
        ship_a.ship("conv", held)
    assert ship_b.read_head("conv") == head  # untouched
    grow(b.store, "conv", 2, seed=10)  # B's turns extend the chain it claimed
    assert ship_b.ship("conv", taken).kind == "segment"


def test_a_damaged_segment_is_refused_and_nothing_is_installed(hosts):
    a, b = hosts
    make_session(a.store, "conv", 50)
    held = a.acquire("conv")
    ship_a = TurnShipper(a)
    ship_a.ship("conv", held)
    grow(a.store, "conv", 5, seed=3)
    ship_a.ship("conv", held)
    ref = ship_a.read_head("conv").last
    key = ship_a.segment_key("conv", ref.name)
    raw = a.fs.cat_file(f"{a.bucket}/{key}")
    bad = bytearray(raw)
    bad[len(bad) // 2] ^= 1
    a.objects.call("put_object", Key=key, Body=bytes(bad))
    time.sleep(1.1)
    taken = b.acquire("conv")
    with pytest.raises(RemoteStoreError, match="could not assemble its chain.*digest"):
        TurnShipper(b).take_over("conv", taken, local_current=False)
    assert not b.store.exists("conv")


def test_a_whole_bundle_push_retires_the_chain(hosts):
    a, _ = hosts
    make_session(a.store, "conv", 20)
    held = a.acquire("conv")
    ship_a = TurnShipper(a)
    ship_a.ship("conv", held)
    grow(a.store, "conv", 4, seed=5)
    ship_a.ship("conv", held)
    _, lease = a.push("conv", release=True)
    ship_a.pushed("conv", lease)
    assert ship_a.read_head("conv") is None
    a.fs.invalidate_cache()
    assert stored_keys(a, "segments") == []


def test_a_truncated_session_ships_a_cut_segment_not_a_new_base(hosts):
    a, b = hosts
    make_session(a.store, "conv", 60)
    held = a.acquire("conv")
    ship_a = TurnShipper(a)
    ship_a.ship("conv", held)
    grow(a.store, "conv", 10, seed=1)
    assert ship_a.ship("conv", held).kind == "segment"
    manifest = a.store.read_manifest("conv")  # a rewind: the epoch first (FORMAT.md 5), then the records
    write_manifest(a.store.session_dir("conv") / "manifest.json",
                   dataclasses.replace(manifest, epoch=manifest.epoch + 1, committed=40))
    with KVWriter.open(a.store.kv_path("conv"), SMALL_DIMS, kv_dtype=manifest.kv_dtype) as writer:
        writer.truncate(40)
    grow(a.store, "conv", 35, seed=2)  # past the chain's 70 again, with records 40.. rewritten
    bundles = stored_keys(a, "bundles")
    report = ship_a.ship("conv", held)
    assert (report.kind, report.start, report.nrec) == ("cut", 40, 75)  # the epoch moved: a cut, from 40
    head = ship_a.read_head("conv")
    assert head.count == 2 and head.nrec == 75
    a.fs.invalidate_cache()
    assert stored_keys(a, "bundles") == bundles  # no new base
    grow(a.store, "conv", 3, seed=3)
    assert ship_a.ship("conv", held).kind == "segment"
    expected = vouched_files(a.store, "conv")
    time.sleep(1.1)
    taken = b.acquire("conv")
    assert TurnShipper(b).take_over("conv", taken, local_current=False)
    assert vouched_files(b.store, "conv") == expected


def vouched_files(store: SessionStore, sid: str) -> dict[str, bytes]:
    """The manifest, the committed kv bytes and the sidecar entries it vouches for (entries past
    its count, stale after a truncate, are ignored by every reader: FORMAT.md 4.1)."""
    manifest = store.read_manifest(sid)
    kv = store.kv_path(sid).read_bytes()
    side = (store.session_dir(sid) / "kv.coli_kv.colisum").read_bytes()
    with open_kv(store.kv_path(sid)) as reader:
        kv = kv[:40 + reader.nrec * reader.record_bytes]
    return {"manifest.json": (store.session_dir(sid) / "manifest.json").read_bytes(), "kv": kv,
            "sidecar": side[:64 + 8 * manifest.committed]}


def test_a_chain_of_its_base_alone_is_taken_over(hosts):
    a, b = hosts
    make_session(a.store, "conv", 33)
    held = a.acquire("conv")
    assert TurnShipper(a).ship("conv", held).kind == "base"  # a session never pushed: its chain's base
    assert a.lease("conv").bundle is None
    expected = session_files(a.store, "conv")
    time.sleep(1.1)
    taken = b.acquire("conv")
    assert TurnShipper(b).take_over("conv", taken, local_current=False)
    assert session_files(b.store, "conv") == expected
