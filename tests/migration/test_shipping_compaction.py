"""Background compaction of shipped chains (FORMAT.md 6.7.3) against a real S3 server (SeaweedFS)
on 127.0.0.1: a turn's ship only asks for it and returns; the compacted chain (a new base, no
segments) reads back token-exact; turns shipped while it uploads land on it (a prepared base); a
host without the lease never compacts and a claim by another host wins over it; a failure or a
SIGKILL mid-compaction leaves the previous chain whole."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kernels.errors import CorruptionError
from sessionstore.migration import compaction, shipping
from sessionstore.migration.exporting import PreparedExport
from sessionstore.migration.object_store import RemoteStoreError
from sessionstore.migration.remote import RemoteStore
from sessionstore.migration.shipping import TurnShipper
from sessionstore.sessions.store import SessionStore
from tests.migration.test_shipping import grow
from tests.support.migrate import make_session, session_files, stored_keys

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hosts(tmp_path, s3_bucket):
    url = s3_bucket.url("fleet")
    a = RemoteStore(SessionStore(tmp_path / "hostA"), url, host_id="host-a", lease_ttl=1.0)
    b = RemoteStore(SessionStore(tmp_path / "hostB"), url, host_id="host-b", lease_ttl=30.0)
    return a, b


@pytest.fixture
def short_chains(monkeypatch):
    """A chain of 3 segments is due for compaction (the rule's other half stays: 4 MiB)."""
    monkeypatch.setattr(compaction, "COMPACT_SEGMENTS", 3)


def segment_names(remote: RemoteStore, sid: str) -> set[str]:
    return {key.rsplit("/", 1)[-1] for key in stored_keys(remote, "segments", sid)}


def bundle_keys(remote: RemoteStore, sid: str) -> set[str]:
    return set(stored_keys(remote, "bundles", sid))


def take_over_files(b: RemoteStore, sid: str) -> dict[str, bytes]:
    """Host B waits out A's lease, takes the chain over and returns the files it installed."""
    time.sleep(1.1)
    taken = b.acquire(sid)
    assert TurnShipper(b, background=False).take_over(sid, taken, local_current=False)
    return session_files(b.store, sid)


def test_a_turn_ship_returns_before_its_compaction_runs(hosts, short_chains):
    a, _ = hosts
    make_session(a.store, "conv", 40)
    held = a.acquire("conv")
    ship_a = TurnShipper(a)
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow_compact(sid, lease):  # a compactor that takes as long as the test wants
        calls.append(sid)
        started.set()
        release.wait(30)
        return "skipped"

    ship_a.compact = slow_compact
    ship_a.ship("conv", held)
    for turn in range(3):
        grow(a.store, "conv", 2, seed=turn + 1)
        t = time.perf_counter()
        report = ship_a.ship("conv", held)
        took = time.perf_counter() - t
        assert report.kind == "segment"
    assert started.wait(10), "the third segment did not ask for a compaction"
    assert not release.is_set() and took < 10  # the ship returned while its compaction is still running
    grow(a.store, "conv", 2, seed=9)  # a turn while it runs: ships, and does not queue a second one
    assert ship_a.ship("conv", held).kind == "segment"
    assert ship_a.read_head("conv").count == 4
    release.set()
    ship_a.compactor.drain()
    assert calls == ["conv", "conv"]  # asked again by the turn after the first one started, run in turn
    ship_a.close()


def test_a_compacted_chain_reads_back_token_exact_and_its_old_objects_go(hosts, short_chains):
    a, b = hosts
    make_session(a.store, "conv", 50)
    held = a.acquire("conv")
    ship_a = TurnShipper(a)
    first_base = ship_a.ship("conv", held)
    assert first_base.kind == "base"
    old_base = ship_a.read_head("conv").base
    for turn, k in enumerate((5, 1, 7)):
        grow(a.store, "conv", k, seed=turn + 1)
        assert ship_a.ship("conv", held).kind == "segment"
    ship_a.compactor.drain()
    head = ship_a.read_head("conv")
    assert head.count == 0 and head.last is None and head.nrec == 63 and head.base_tokens == 63
    assert head.base != old_base and head.generation == held.generation and head.owner == "host-a"
    assert segment_names(a, "conv") == set()  # the replaced chain: its segments and its base deleted
    assert bundle_keys(a, "conv") == {head.base}
    grow(a.store, "conv", 4, seed=8)  # the chain goes on from the new base
    report = ship_a.ship("conv", held)
    assert report.kind == "segment" and report.start == 63 and report.nrec == 67
    expected = session_files(a.store, "conv")
    ship_a.close()
    assert take_over_files(b, "conv") == expected


def test_turns_shipped_while_a_compaction_uploads_land_on_its_prepared_base(hosts, monkeypatch):
    a, b = hosts
    make_session(a.store, "conv", 30)
    held = a.acquire("conv")
    ship_a = TurnShipper(a, background=False)  # never due here: compact() is called by the test
    ship_a.ship("conv", held)
    for turn in range(3):
        grow(a.store, "conv", 3, seed=turn + 1)
        ship_a.ship("conv", held)
    before = ship_a.read_head("conv")
    assert before.count == 3 and before.nrec == 39

    class TurnDuringUpload(PreparedExport):
        def write(self, sink, **kw):  # the bundle holds 39 records; a turn ships 2 more meanwhile
            out = super().write(sink, **kw)
            grow(a.store, "conv", 2, seed=7)
            assert ship_a.ship("conv", held).nrec == 41
            return out

    monkeypatch.setattr(shipping, "PreparedExport", TurnDuringUpload)
    assert ship_a.compact("conv", held) == "prepared"
    assert ship_a.read_head("conv").base == before.base  # the head did not move to it: turns shipped since
    grow(a.store, "conv", 1, seed=8)
    report = ship_a.ship("conv", held)
    assert (report.kind, report.start, report.nrec) == ("segment", 39, 42)  # from the prepared base's end
    head = ship_a.read_head("conv")
    assert head.count == 1 and head.base_tokens == 39 and head.base != before.base and head.last.start == 39
    assert segment_names(a, "conv") == {head.last.name}  # the replaced chain's segments went
    expected = session_files(a.store, "conv")
    assert take_over_files(b, "conv") == expected


def test_a_host_that_lost_its_lease_never_compacts(hosts, short_chains):
    a, b = hosts
    make_session(a.store, "conv", 20)
    held = a.acquire("conv")
    ship_a = TurnShipper(a, background=False)
    ship_a.ship("conv", held)
    grow(a.store, "conv", 2, seed=1)
    ship_a.ship("conv", held)
    bundles = bundle_keys(a, "conv")
    time.sleep(1.1)  # A's lease expires; B takes it (not yet the chain)
    b.acquire("conv")
    assert ship_a.compact("conv", held) == "fenced"
    assert bundle_keys(a, "conv") == bundles  # nothing uploaded
    assert ship_a.read_head("conv").owner == "host-a" and ship_a.read_head("conv").count == 1


def test_a_claim_during_a_compaction_wins_and_its_bundle_is_deleted(hosts, short_chains, monkeypatch):
    a, b = hosts
    make_session(a.store, "conv", 20)
    held = a.acquire("conv")
    ship_a = TurnShipper(a, background=False)
    ship_a.ship("conv", held)
    grow(a.store, "conv", 2, seed=1)
    ship_a.ship("conv", held)
    expected = session_files(a.store, "conv")
    bundles = bundle_keys(a, "conv")
    ship_b = TurnShipper(b, background=False)

    class ClaimedDuringUpload(PreparedExport):
        def write(self, sink, **kw):  # A stalls past its lease; B takes the session and claims the head
            out = super().write(sink, **kw)
            time.sleep(1.1)
            assert ship_b.take_over("conv", b.acquire("conv"), local_current=False)
            return out

    monkeypatch.setattr(shipping, "PreparedExport", ClaimedDuringUpload)
    assert ship_a.compact("conv", held) == "fenced"
    head = ship_a.read_head("conv")
    assert head.owner == "host-b" and head.count == 1  # B's claimed chain, untouched
    assert bundle_keys(a, "conv") == bundles  # A's compacted bundle deleted
    assert session_files(b.store, "conv") == expected


def test_a_head_rewritten_during_a_compaction_is_never_replaced(hosts, monkeypatch):
    a, _ = hosts
    make_session(a.store, "conv", 20)
    held = a.acquire("conv")
    ship_a = TurnShipper(a, background=False)
    ship_a.ship("conv", held)
    grow(a.store, "conv", 2, seed=1)
    ship_a.ship("conv", held)
    bundles = bundle_keys(a, "conv")

    class HeadMovedDuringUpload(PreparedExport):
        def write(self, sink, **kw):  # another writer's head lands before the lease shows it
            out = super().write(sink, **kw)
            head = ship_a.read_head("conv")
            other = dataclasses.replace(head, owner="host-b", generation=head.generation + 1)
            key = ship_a.chain_objects.head_key("conv")
            a.objects.call("put_object", Key=key, Body=other.body(), IfMatch=head.etag)
            return out

    monkeypatch.setattr(shipping, "PreparedExport", HeadMovedDuringUpload)
    assert ship_a.compact("conv", held) == "fenced"  # its If-Match refused: the bundle is deleted
    head = ship_a.read_head("conv")
    assert head.owner == "host-b" and head.count == 1
    assert bundle_keys(a, "conv") == bundles


def test_a_failure_mid_compaction_leaves_the_chain_whole(hosts, monkeypatch):
    a, b = hosts
    make_session(a.store, "conv", 25)
    held = a.acquire("conv")
    ship_a = TurnShipper(a, background=False)
    ship_a.ship("conv", held)
    for turn in range(2):
        grow(a.store, "conv", 3, seed=turn + 1)
        ship_a.ship("conv", held)
    before = ship_a.read_head("conv")

    class FailingUpload(PreparedExport):
        def write(self, sink, **kw):
            sink.write(b"half a bundle")
            raise CorruptionError("kv.coli_kv: record 3 hashes 0x1, the sidecar vouches for 0x2")

    monkeypatch.setattr(shipping, "PreparedExport", FailingUpload)
    bundles = bundle_keys(a, "conv")
    with pytest.raises(CorruptionError):
        ship_a.compact("conv", held)
    assert bundle_keys(a, "conv") == bundles  # the half upload was discarded
    monkeypatch.undo()
    real_call = ship_a.objects.call

    def head_write_fails(op, **kw):  # the bundle is up; the head write fails (the store drops it)
        if op == "put_object" and kw.get("Key") == ship_a.chain_objects.head_key("conv"):
            raise ConnectionResetError("connection reset by peer")
        return real_call(op, **kw)

    monkeypatch.setattr(ship_a.objects, "call", head_write_fails)
    with pytest.raises(RemoteStoreError):
        ship_a.compact("conv", held)
    monkeypatch.undo()
    assert ship_a.read_head("conv") == before  # the previous chain, as it was
    expected = session_files(a.store, "conv")
    assert take_over_files(b, "conv") == expected


KILLED_COMPACTION = """
import os, signal, sys
from sessionstore.migration import compaction, shipping
from sessionstore.migration.exporting import PreparedExport
from sessionstore.migration.remote import RemoteStore
from sessionstore.sessions.store import SessionStore
from tests.migration.test_shipping import grow
from tests.support.migrate import make_session

compaction.COMPACT_SEGMENTS = 2
a = RemoteStore(SessionStore(sys.argv[2]), sys.argv[1], host_id="host-a", lease_ttl=1.0)
make_session(a.store, "conv", 25)
held = a.acquire("conv")
ship = shipping.TurnShipper(a, background=False)
ship.ship("conv", held)
for turn in range(2):
    grow(a.store, "conv", 3, seed=turn + 1)
    ship.ship("conv", held)

class KilledMidUpload(PreparedExport):
    def write(self, sink, **kw):
        sink.write(b"x" * (6 << 20))  # a part of the upload is in flight
        sink.flush()
        os.kill(os.getpid(), signal.SIGKILL)

shipping.PreparedExport = KilledMidUpload
ship.compact("conv", held)
"""


def test_a_sigkill_mid_compaction_leaves_the_chain_whole(hosts, tmp_path):
    a, b = hosts
    proc = subprocess.run([sys.executable, "-c", KILLED_COMPACTION, a.url, str(tmp_path / "hostA")],
                          cwd=REPO, env={**os.environ, "COLI_LOG": "off"}, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    head = TurnShipper(a, background=False).read_head("conv")
    assert head.owner == "host-a" and head.count == 2 and head.nrec == 31  # the chain it shipped, whole
    assert take_over_files(b, "conv") == session_files(a.store, "conv")
