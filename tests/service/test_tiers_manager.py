"""The tier manager (FORMAT.md 5.10) on a real S3 server (SeaweedFS) without a model: an offload
ships, verifies and leaves a stub (manifest, state page, tier record), listed offloaded; a restore
brings back the very files (kv records, sidecar, manifest) and the tier record; a pinned session,
or one another host holds live, is never offloaded; a stub whose mark landed but whose files were
not removed yet (a crash between) restores all the same; a turn that cannot fit is a 507 naming the
budget; without a fleet an offloaded session is a 409 that says so; expiry deletes a stub and its
bundles."""
from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import sessionstore.service.engine.tiers as tiers
import sessionstore.service.fleet.home as fleet_home
from kernels.errors import ColiError
from sessionstore.migration import RemoteStore
from sessionstore.service.engine.metrics import EngineMetrics
from sessionstore.service.engine.tiers import STUB_NAMES, TierManager
from sessionstore.service.errors import ApiError
from sessionstore.service.fleet import FleetHome
from sessionstore.sessions import SessionStore
from sessionstore.sessions.disk_usage import session_disk_bytes
from sessionstore.sessions.manifest import write_manifest
from sessionstore.sessions.paths import KV_NAME
from sessionstore.sessions.tier_record import Offloaded, TierChange, TierRecord, read_tier, write_tier
from tests.support.migrate import make_session, session_files, stored_keys
from tests.support.seaweed import Bucket

pytestmark = pytest.mark.timeout(120)


class Engine:
    """What the tier manager reads of the service's engine (no model: nothing is ever open)."""

    def __init__(self, store: SessionStore, home: FleetHome | None) -> None:
        self.store, self.home = store, home
        self.metrics = EngineMetrics()
        self.last_use: dict[str, float] = {}
        self.busy: set[str] = set()

    def forget(self, session_id: str) -> None:
        pass

    def claim(self, session_id: str) -> None:
        if session_id in self.busy:
            raise ApiError(409, f"session {session_id!r} is busy", code="session_busy")

    def release(self, session_id: str | None) -> None:
        pass

    def delete(self, session_id: str) -> None:
        if self.home is not None:
            self.home.forget(session_id)
        self.store.delete(session_id)


@pytest.fixture
def fleet(tmp_path: Path, s3_bucket: Bucket) -> tuple[SessionStore, RemoteStore]:
    store = SessionStore(tmp_path / "host")
    return store, RemoteStore(store, s3_bucket.url("fleet"), host_id="host-a")


def bundles(remote: RemoteStore, sid: str) -> list[str]:
    return stored_keys(remote, "bundles", sid)


def test_offload_leaves_a_stub_and_restore_brings_back_the_same_files(
        fleet: tuple[SessionStore, RemoteStore]) -> None:
    store, remote = fleet
    make_session(store, "a", 40, seed=3)
    write_tier(store.session_dir("a"), TierRecord(600, False))
    before = session_files(store, "a")
    d = store.session_dir("a")
    size = sum(os.path.getsize(d / n) for n in os.listdir(d) if n not in STUB_NAMES)  # what offloading frees
    assert size > os.path.getsize(store.kv_path("a"))  # the sidecar and the rest count too
    manager = TierManager(Engine(store, FleetHome(remote)))

    assert manager.offload("a")
    d = store.session_dir("a")
    assert set(os.listdir(d)) <= STUB_NAMES and KV_NAME not in os.listdir(d)
    record = read_tier(d)
    assert record.retention_seconds == 600 and record.offloaded is not None
    assert record.offloaded.bytes == size and record.offloaded.tokens == 40
    lease = remote.lease("a")
    assert lease is not None and lease.released and lease.bundle == record.offloaded.bundle
    row = store.catalogue.get("a")
    assert row is not None and row.state == "offloaded" and row.location.endswith(record.offloaded.bundle)
    assert store.catalogue.bytes_by_state() == {"offloaded": size}
    assert not manager.offload("a")  # already offloaded

    manager.restore("a", record)
    assert session_files(store, "a") == before  # the very records, sidecar and manifest
    assert read_tier(d) == TierRecord(600, False)
    assert store.catalogue.get("a").state == "suspended"  # type: ignore[union-attr]
    # restored means checked out here: the next offload pushes it again, the superseded bundle deleted
    assert manager.offload("a") and len(bundles(remote, "a")) == 1
    assert manager.metrics.offloads._value.get() == 2 and manager.metrics.restores._value.get() == 1


def test_pinned_busy_or_held_elsewhere_is_never_offloaded(fleet: tuple[SessionStore, RemoteStore]) -> None:
    store, remote = fleet
    for sid in ("pin", "busy", "theirs"):
        make_session(store, sid, 8)
    engine = Engine(store, FleetHome(remote))
    manager = TierManager(engine)
    manager.change("pin", TierChange(pinned=True))
    engine.busy.add("busy")
    RemoteStore(SessionStore(store.root.parent / "other"), remote.url, host_id="host-b").acquire("theirs")
    for sid in ("pin", "busy", "theirs"):
        assert not manager.offload(sid), sid
        assert os.path.exists(store.kv_path(sid)) and read_tier(store.session_dir(sid)).offloaded is None
    assert bundles(remote, "pin") == [] and bundles(remote, "theirs") == []


def test_a_stub_whose_files_were_not_removed_yet_restores(fleet: tuple[SessionStore, RemoteStore]) -> None:
    store, remote = fleet
    make_session(store, "a", 12, seed=5)
    before = session_files(store, "a")
    manager = TierManager(Engine(store, FleetHome(remote)))
    assert manager.offload("a")
    record = read_tier(store.session_dir("a"))
    assert record.offloaded is not None
    # as if killed between the mark and the unlinks: the mark is there, so are (stale) files
    (store.session_dir("a") / KV_NAME).write_bytes(b"stale")
    assert store.catalogue.refresh() in ("fresh", "reconciled")
    fresh = TierManager(Engine(store, FleetHome(remote)))  # a restarted server knows nothing of it
    fresh.restore("a", record)
    assert session_files(store, "a") == before


def test_expiry_deletes_a_stub_and_its_bundles(fleet: tuple[SessionStore, RemoteStore]) -> None:
    store, remote = fleet
    make_session(store, "a", 6)
    manager = TierManager(Engine(store, FleetHome(remote)))
    assert manager.offload("a") and bundles(remote, "a")
    assert manager.expire("a")
    assert not store.exists("a") and remote.lease("a") is None and bundles(remote, "a") == []
    assert store.catalogue.get("a") is None


def test_without_a_fleet_an_offloaded_session_is_a_409_and_no_room_is_a_507(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "host")
    make_session(store, "a", 4)
    manager: Any = TierManager(Engine(store, None), max_disk_bytes=1000)
    assert not manager.offload("a")  # nothing to offload to
    record = TierRecord(offloaded=None)
    marked = TierRecord(None, False, Offloaded("s3://b/p", "p/bundles/a/x", 10, 4, "t"))
    write_tier(store.session_dir("a"), marked)
    with pytest.raises(ApiError) as err:
        manager.restore("a", marked)
    assert err.value.status == 409 and err.value.code == "session_offloaded"
    write_tier(store.session_dir("a"), record)
    with pytest.raises(ApiError) as err:
        manager.make_room(5000, keep="b")
    assert err.value.status == 507 and err.value.code == "insufficient_storage"
    assert "--max-disk-bytes 1000" in err.value.message and "no --remote" in err.value.message


class _Events:
    """A module's ``log`` recorded (the tests run with logs off): each event as (level, event, fields)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.seen.append((level, event, fields))


def _offloaded(store: SessionStore) -> list[str]:
    return [sid for sid in "abc" if read_tier(store.session_dir(sid)).offloaded is not None]


def _make_room(manager: TierManager, remote: RemoteStore, needed: int, events: _Events) -> None:
    """``manager.make_room``; a 507 whose offloads failed in the object store (a request to the shared
    S3 server refused or timed out on a loaded machine: logged, and the session left local, as the
    server's next turn or sweep would find it) is asked once more, once the store answers again. The
    test asserts which sessions go, in which order; a 507 for any other reason fails it, and every
    failure shows the tier manager's and the fleet's warnings."""
    for attempt in (1, 2):
        try:
            manager.make_room(needed, keep="new")
            return
        except ApiError as exc:
            store_failed = [e for e in events.seen if e[1] in ("tiers.offload_failed", "fleet.push_failed")]
            if attempt == 2 or exc.status != 507 or not store_failed:
                raise AssertionError(f"make_room({needed}): {exc.status} {exc.message}; "
                                     f"events: {events.seen}") from None
            _wait_for_the_store(remote)


def _wait_for_the_store(remote: RemoteStore, timeout_s: float = 30.0) -> None:
    """Until a read of the object store succeeds (a lease's: none or one, either way an answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            remote.lease("b")
            return
        except ColiError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_the_lru_order_comes_from_the_files_so_it_survives_a_restart(
        fleet: tuple[SessionStore, RemoteStore], monkeypatch: pytest.MonkeyPatch) -> None:
    store, remote = fleet
    events = _Events()
    monkeypatch.setattr(tiers, "log", events)  # why an offload was skipped, shown if the test fails
    monkeypatch.setattr(fleet_home, "log", events)
    for sid in ("b", "a", "c"):  # made in this order: b is the least recently used, then a, then c
        make_session(store, sid, 8)
        time.sleep(0.01)
    size = session_disk_bytes(store.session_dir("a"))  # each session's files (the same sizes for all three)
    # "a" is used again: its manifest's updated_at (what a commit writes) moves past c's
    manifest = store.read_manifest("a")
    write_manifest(store.session_dir("a") / "manifest.json", manifest)
    store.note_session(store.read_manifest("a"), resident=False)
    restarted = TierManager(Engine(SessionStore(store.root), FleetHome(remote)), max_disk_bytes=3 * size)
    _make_room(restarted, remote, size, events)  # room for one more: the least recently used goes
    assert _offloaded(store) == ["b"], events.seen
    _make_room(restarted, remote, 2 * size, events)
    assert _offloaded(store) == ["b", "c"], events.seen


def test_the_budget_counts_every_file_of_a_session_not_its_kv_file_alone(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "host")
    for sid in ("a", "b"):
        make_session(store, sid, 8)
    kv_only = sum(os.path.getsize(store.kv_path(sid)) for sid in "ab")
    (store.session_dir("b") / "conversation.json").write_bytes(b"x" * 50_000)  # b's records, grown by a turn
    store.note_session(store.read_manifest("b"), resident=False)  # what its commit records
    files = sum(session_disk_bytes(store.session_dir(sid)) for sid in "ab")
    assert files > kv_only + 50_000  # sidecars, manifests, state pages and b's records on top of the kv files
    assert store.catalogue.bytes_by_state() == {"suspended": files}
    manager: Any = TierManager(Engine(store, None), max_disk_bytes=kv_only + 20_000)
    assert manager.local_bytes() == files
    with pytest.raises(ApiError) as err:  # the kv files alone would leave room for it
        manager.make_room(10_000, keep="c")
    assert err.value.status == 507 and f"holds {files} of its" in err.value.message
    TierManager(Engine(store, None), max_disk_bytes=files + 10_000).make_room(10_000, keep="c")  # it fits


def _counting_catalogue_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """SQLite virtual-machine steps run on the catalogue's connection from now on ([0] counts
    them): a scan's steps grow with the rows it reads, a lookup's do not."""
    steps = [0]
    real = sqlite3.connect

    def connect(*args: Any, **kw: Any) -> sqlite3.Connection:
        db = real(*args, **kw)

        def step() -> int:
            steps[0] += 1
            return 0

        db.set_progress_handler(step, 1)
        return db

    monkeypatch.setattr(sqlite3, "connect", connect)
    return steps


@pytest.mark.parametrize("rows", [10, 2000])
def test_a_budgeted_turn_that_fits_reads_no_more_of_the_catalogue_in_a_big_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    steps = _counting_catalogue_steps(monkeypatch)
    store = SessionStore(tmp_path / "host")
    make_session(store, "a", 4)
    row = store.catalogue.get("a")
    assert row is not None
    for i in range(rows):  # rows as the catalogue lists them (their files are not read here)
        store.catalogue.note(replace(row, id=f"r{i:05d}", bytes=1000 + i))
    local = row.bytes + sum(1000 + i for i in range(rows))
    manager: Any = TierManager(Engine(store, None), max_disk_bytes=local + 5000)
    assert manager.local_bytes() == local  # exact: every row's bytes

    before = steps[0]
    manager.make_room(5000, keep="b")  # fits to the byte
    per_turn = steps[0] - before
    assert per_turn < 400, per_turn  # a few lookups, whatever the store holds (a scan of 10 rows is ~300)
    with pytest.raises(ApiError) as err:
        manager.make_room(5001, keep="b")  # one byte more: the full plan, which finds no room either
    assert err.value.status == 507 and f"holds {local} of its" in err.value.message
