"""A turn that cuts the history (a truncate: regenerate, edit, a re-tokenized boundary) ships a cut
segment of O(new records), not a new base (FORMAT.md 6.7.3, issue 38 part 2), against a real S3
server (SeaweedFS) on 127.0.0.1: the bytes shipped are bounded by the records after the cut point;
another host takes the chain over token-exact after a cut, after several truncates between two
ships, after a cut below the base and after cut + appends + compaction; a host that lost the lease
cannot ship a cut; a SIGKILL between the cut's upload and the head's move leaves the chain before it
readable."""
from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kernels.errors import CorruptionError, LockedError
from sessionstore.kvfile import KVWriter
from sessionstore.migration import compaction
from sessionstore.migration.chain_reader import ChainFiles
from sessionstore.migration.remote import RemoteStore
from sessionstore.migration.segment_format import CUT_SEGMENT_VERSION, SEGMENT_VERSION, Segment, parse_segment
from sessionstore.migration.segment_writing import cut_point
from sessionstore.migration.shipping import TurnShipper
from sessionstore.sessions.manifest import write_manifest
from sessionstore.sessions.store import SessionStore
from tests.migration.test_shipping import FIXED_BYTES, grow, vouched_files
from tests.support.migrate import SMALL_DIMS, make_session, stored_keys

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hosts(tmp_path, s3_bucket):
    url = s3_bucket.url("fleet")
    a = RemoteStore(SessionStore(tmp_path / "hostA"), url, host_id="host-a", lease_ttl=1.0)
    b = RemoteStore(SessionStore(tmp_path / "hostB"), url, host_id="host-b", lease_ttl=30.0)
    return a, b


def truncate(store: SessionStore, sid: str, n: int) -> None:
    """Prefix reuse as the session does it (FORMAT.md 5.5): the epoch first, then the records."""
    manifest = store.read_manifest(sid)
    write_manifest(store.session_dir(sid) / "manifest.json",
                   dataclasses.replace(manifest, epoch=manifest.epoch + 1, committed=n))
    with KVWriter.open(store.kv_path(sid), SMALL_DIMS, kv_dtype=manifest.kv_dtype) as writer:
        writer.truncate(n)


def take_over(b: RemoteStore, sid: str) -> dict[str, bytes]:
    """Host B waits out A's lease, takes the chain over and returns the files it installed."""
    time.sleep(1.1)
    taken = b.acquire(sid)
    assert TurnShipper(b, background=False).take_over(sid, taken, local_current=False)
    return vouched_files(b.store, sid)


def segment_version(remote: RemoteStore, shipper: TurnShipper, sid: str) -> int:
    ref = shipper.read_head(sid).last
    key = shipper.segment_key(sid, ref.name)
    data = remote.fs.cat_file(f"{remote.bucket}/{key}")
    return parse_segment(data, key, session_id=sid, digest=ref.digest).version


def test_cut_point_is_the_first_differing_entry():
    shipped = np.arange(10, dtype="<u8")  # [10] u64
    assert cut_point(shipped, np.arange(14, dtype="<u8")) == 10  # an append
    assert cut_point(shipped, np.arange(6, dtype="<u8")) == 6  # cut, nothing new yet
    changed = np.arange(12, dtype="<u8")
    changed[7] = 99
    assert cut_point(shipped, changed) == 7


def test_the_chain_reader_applies_a_cut_below_its_end_and_refuses_one_at_or_past_it(tmp_path):
    files = ChainFiles(str(tmp_path))
    try:
        files.kv_info, files.nrec = {"record_bytes": 4, "nrec": 10}, 10

        def seg(start: int, nrec: int, version: int) -> Segment:
            parts = {"kv_header": b"h" * 40, "records": b"r" * 4 * (nrec - start), "sidecar_header": b"s" * 64,
                     "entries": b"e" * 8 * (nrec - start), "manifest.json": b"{}"}
            return Segment("conv", 1, start, nrec, 4, {"record_bytes": 4, "nrec": nrec}, parts, None, version)

        with pytest.raises(CorruptionError, match="starts at record 6"):
            files.apply(seg(6, 9, SEGMENT_VERSION), "v1")  # an append must start at the chain's end
        with pytest.raises(CorruptionError, match="a cut at record 10"):
            files.apply(seg(10, 12, CUT_SEGMENT_VERSION), "v2")  # a cut must lie below it
        files.apply(seg(6, 8, CUT_SEGMENT_VERSION), "v2")
        assert files.nrec == 8
        files.kv.seek(40 + 6 * 4)
        assert files.kv.read(8) == b"r" * 8
    finally:
        files.close()


def test_a_cut_ships_its_new_records_and_another_host_installs_it_token_exact(hosts):
    a, b = hosts
    make_session(a.store, "conv", 300)
    held = a.acquire("conv")
    ship_a = TurnShipper(a, background=False)
    assert ship_a.ship("conv", held).kind == "base"
    grow(a.store, "conv", 20, seed=1)
    append = ship_a.ship("conv", held)
    assert append.kind == "segment" and segment_version(a, ship_a, "conv") == SEGMENT_VERSION
    truncate(a.store, "conv", 307)  # a regenerate: the reply's records from 307 on are replaced
    grow(a.store, "conv", 13, seed=2)
    report = ship_a.ship("conv", held)
    assert (report.kind, report.start, report.nrec) == ("cut", 307, 320), report
    assert report.shipped_bytes <= 1.5 * report.record_bytes + FIXED_BYTES, report  # O(new records)
    assert report.shipped_bytes < 0.25 * append.object_bytes * 300 / 20  # far below a base of the session
    assert segment_version(a, ship_a, "conv") == CUT_SEGMENT_VERSION  # an old reader refuses, never misreads
    truncate(a.store, "conv", 310)  # two truncates between ships: the cut is the lower point
    grow(a.store, "conv", 4, seed=3)
    truncate(a.store, "conv", 305)
    grow(a.store, "conv", 6, seed=4)
    report = ship_a.ship("conv", held)
    assert (report.kind, report.start, report.nrec) == ("cut", 305, 311), report
    grow(a.store, "conv", 5, seed=5)  # an append after the cuts
    assert ship_a.ship("conv", held).kind == "segment"
    head = ship_a.read_head("conv")
    assert (head.nrec, head.count) == (316, 4)
    a.fs.invalidate_cache()
    assert stored_keys(a, "bundles", "conv") == [head.base]  # no new base was uploaded
    assert take_over(b, "conv") == vouched_files(a.store, "conv")


def test_a_cut_below_the_base_and_a_compaction_after_cuts_read_back_token_exact(hosts, monkeypatch):
    a, b = hosts
    monkeypatch.setattr(compaction, "COMPACT_SEGMENTS", 3)
    make_session(a.store, "conv", 80)
    held = a.acquire("conv")
    ship_a = TurnShipper(a)  # compacts on its worker
    ship_a.ship("conv", held)
    truncate(a.store, "conv", 30)  # an edit of an early message: the cut lies inside the base
    grow(a.store, "conv", 9, seed=1)
    report = ship_a.ship("conv", held)
    assert (report.kind, report.start, report.nrec) == ("cut", 30, 39)
    grow(a.store, "conv", 4, seed=2)
    assert ship_a.ship("conv", held).kind == "segment"
    truncate(a.store, "conv", 41)
    grow(a.store, "conv", 3, seed=3)
    assert ship_a.ship("conv", held).kind == "cut"  # the third segment: due, compacted after it
    ship_a.compactor.drain()
    head = ship_a.read_head("conv")
    assert head.count == 0 and head.nrec == 44  # the cuts folded into the new base like appends
    truncate(a.store, "conv", 42)  # a cut on the compacted base
    grow(a.store, "conv", 5, seed=4)
    assert ship_a.ship("conv", held).start == 42
    ship_a.close()
    assert take_over(b, "conv") == vouched_files(a.store, "conv")


def test_a_host_that_lost_the_lease_cannot_ship_a_cut(hosts):
    a, b = hosts
    make_session(a.store, "conv", 60)
    held = a.acquire("conv")
    ship_a = TurnShipper(a, background=False)
    ship_a.ship("conv", held)
    grow(a.store, "conv", 6, seed=1)
    ship_a.ship("conv", held)
    expected = vouched_files(a.store, "conv")
    assert take_over(b, "conv") == expected  # B claimed the head
    claimed = ship_a.read_head("conv")
    segments = stored_keys(a, "segments", "conv")
    truncate(a.store, "conv", 50)
    grow(a.store, "conv", 3, seed=2)
    with pytest.raises(LockedError, match="taken over"):
        ship_a.ship("conv", held)
    assert ship_a.read_head("conv") == claimed  # untouched
    a.fs.invalidate_cache()
    assert stored_keys(a, "segments", "conv") == segments  # its cut segment was deleted


KILLED_CUT = """
import os, pickle, signal, sys
from sessionstore.migration import chain_objects, shipping
from sessionstore.migration.remote import RemoteStore
from sessionstore.sessions.store import SessionStore
from tests.migration.test_shipping import grow, vouched_files
from tests.migration.test_shipping_cuts import truncate
from tests.support.migrate import make_session

a = RemoteStore(SessionStore(sys.argv[2]), sys.argv[1], host_id="host-a", lease_ttl=1.0)
make_session(a.store, "conv", 40)
held = a.acquire("conv")
ship = shipping.TurnShipper(a, background=False)
ship.ship("conv", held)
grow(a.store, "conv", 5, seed=1)
ship.ship("conv", held)
with open(sys.argv[3], "wb") as f:  # the files of the last acknowledged turn
    pickle.dump(vouched_files(a.store, "conv"), f)
truncate(a.store, "conv", 42)
grow(a.store, "conv", 7, seed=2)

def killed(self, *args, **kw):  # the cut segment is uploaded; the host dies before the head moves
    os.kill(os.getpid(), signal.SIGKILL)

chain_objects.ChainObjects.write_head = killed
ship.ship("conv", held)
"""


def test_a_sigkill_between_the_cuts_upload_and_the_head_leaves_a_readable_chain(hosts, tmp_path):
    a, b = hosts
    acknowledged = tmp_path / "acknowledged.pickle"
    proc = subprocess.run([sys.executable, "-c", KILLED_CUT, a.url, str(tmp_path / "hostA"), str(acknowledged)],
                          cwd=REPO, env={**os.environ, "COLI_LOG": "off"}, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    head = TurnShipper(a, background=False).read_head("conv")
    assert (head.nrec, head.count) == (45, 1)  # the chain before the cut, whole
    a.fs.invalidate_cache()
    assert len(stored_keys(a, "segments", "conv")) == 2  # the cut's segment is there, unnamed
    assert take_over(b, "conv") == pickle.loads(acknowledged.read_bytes())  # the last acknowledged turn
