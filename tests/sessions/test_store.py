"""SessionStore: layout, confinement, listing without locks, fork copies, adopt, snapshot, budget."""
from __future__ import annotations

import errno
import gc
import json
import os
import threading
from pathlib import Path

import pytest

from kernels.errors import ColiError, CorruptionError, FormatError, LockedError, NotFoundError
from sessionstore.kvfile import copying
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import load_sidecar
from sessionstore.kvfile.sidecar_check import check_records
from sessionstore.sessions import SessionOptions
from sessionstore.sessions.directory import STATE_NAME
from sessionstore.sessions.manifest import MANIFEST_NAME, read_manifest
from sessionstore.sessions.paths import KV_NAME, LOCK_NAME, SIDECAR_NAME, InvalidSessionIdError
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turn_loop import common_prefix
from tests.support.migrate import files_of

PROMPT = list(b"Hello, store")


@pytest.fixture()
def store(tmp_path) -> SessionStore:
    return SessionStore(tmp_path / "root")


def _make(store: SessionStore, sid: str, n: int = 4, kv: str = "fp8") -> None:
    s = store.create(sid, "tiny", kv_dtype=kv)
    s.generate(PROMPT, n)
    s.close()


def test_layout_and_public_paths(store) -> None:
    _make(store, "s1")
    d = store.session_dir("s1")
    assert d == store.root / "sessions" / "s1"
    assert sorted(p.name for p in d.iterdir()) == sorted([MANIFEST_NAME, KV_NAME, SIDECAR_NAME, LOCK_NAME,
                                                          STATE_NAME])  # commits wrote the state page
    assert [p.name for p in files_of(store, "s1")] == [MANIFEST_NAME, KV_NAME, SIDECAR_NAME, STATE_NAME]
    tmp = store.directory.tmp_dir()
    assert tmp.parent == store.root / "tmp" and not any(tmp.iterdir())
    assert not any(p.name.startswith("t-") for p in (store.root / "sessions").iterdir())


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", ".", "", "x" * 200, "a\nb", "/etc"])
def test_ids_are_confined(store, bad) -> None:
    _make(store, "ok")
    for call in (lambda: store.create(bad, "tiny"), lambda: store.open(bad), lambda: store.delete(bad),
                 lambda: store.fork("ok", bad), lambda: store.fork(bad, "new"), lambda: store.info(bad)):
        with pytest.raises(ColiError):
            call()
    assert [i.id for i in store.directory.list()] == ["ok"]
    assert not (store.root.parent / "x").exists()


def test_symlink_escape_is_refused(store, tmp_path) -> None:
    _make(store, "real")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, store.root / "sessions" / "evil")
    with pytest.raises(FormatError, match="symlink"):
        store.open("evil")
    with pytest.raises(FormatError, match="symlink"):
        store.create("evil", "tiny")
    with pytest.raises(FormatError, match="symlink"):
        store.delete("evil")
    assert [i.id for i in store.directory.list()] == ["real"]  # logged and skipped, never followed
    assert not any(outside.iterdir())
    kv = store.kv_path("real")  # a session whose kv file became a symlink
    target = tmp_path / "elsewhere.coli_kv"
    os.replace(kv, target)
    os.symlink(target, kv)
    with pytest.raises(FormatError, match="symlink"):
        store.open("real")


def test_listing_reports_and_skips_strays(store) -> None:
    _make(store, "b", kv="f32")
    _make(store, "a")
    (store.root / "sessions" / ".stray").mkdir()
    (store.root / "sessions" / "junk").mkdir()  # a dir without a manifest
    infos = store.directory.list()
    assert [i.id for i in infos] == ["a", "b"]
    a = infos[0].to_json()
    assert set(a) >= {"id", "tokens", "kv_dtype", "kv_path", "bytes", "model"}
    assert a["tokens"] == len(PROMPT) + 3 and a["kv_dtype"] == "fp8" and a["model"] == "tiny"
    d = Path(a["kv_path"]).parent  # every file of the session counts, not the kv file alone
    assert a["bytes"] == sum(f.stat().st_size for f in d.iterdir()) > os.path.getsize(a["kv_path"])
    json.dumps(a)


def test_create_refuses_existing_and_open_missing(store) -> None:
    _make(store, "s")
    with pytest.raises(FormatError, match="already exists"):
        store.create("s", "tiny")
    with pytest.raises(NotFoundError):
        store.open("nope")
    with pytest.raises(NotFoundError):
        store.delete("nope")


def test_delete_refused_while_locked(store) -> None:
    s = store.create("s", "tiny")
    s.generate(PROMPT, 2)
    with pytest.raises(LockedError):
        SessionStore(store.root).delete("s")
    s.close()
    store.delete("s")
    assert store.directory.list() == [] and not store.session_dir("s").exists()


@pytest.mark.parametrize("method", ["reflink-or-range", "plain-copy"])
def test_fork_copies_only_the_committed_prefix(store, monkeypatch, method) -> None:
    if method == "plain-copy":
        def no_clone(*args: object) -> None:  # the file system has no reflinks
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")

        monkeypatch.setattr(copying.fcntl, "ioctl", no_clone)
        monkeypatch.setattr(copying.os, "copy_file_range",
                            lambda *a: (_ for _ in ()).throw(OSError(18, "EXDEV")))
    _make(store, "src", n=6)
    src_tokens = store.history("src")
    info = store.fork("src", "half", at=5)
    assert info.tokens == 5
    assert store.history("half") == src_tokens[:5] + [src_tokens[5]]  # record 5 becomes pending
    with open_kv(store.kv_path("half")) as r:
        assert r.nrec == 5 and r.stale_tail_bytes == 0 and r.file_bytes == 40 + 5 * r.record_bytes
        report = check_records(r, load_sidecar(r.path))
        assert report.status == "ok" and report.vouched == 5
        with open_kv(store.kv_path("src")) as s:
            assert bytes(r.records_bytes_view(0, 5)) == bytes(s.records_bytes_view(0, 5))
    m = read_manifest(store.session_dir("half") / MANIFEST_NAME)
    assert m.origin == "fork of src at 5" and m.last_logits is None
    with pytest.raises(FormatError):
        store.fork("src", "bad", at=10_000)
    with pytest.raises(FormatError, match="already exists"):
        store.fork("src", "half")


def test_fork_detects_a_damaged_source(store) -> None:
    _make(store, "src", n=6)
    kv = store.kv_path("src")
    raw = bytearray(kv.read_bytes())
    raw[60] ^= 1
    kv.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="failed its check") as info:
        store.fork("src", "copy")
    assert str(kv) in str(info.value) and str(store.root / "tmp") not in str(info.value)  # the damaged file
    assert [i.id for i in store.directory.list()] == ["src"]  # nothing half-made is left behind
    assert not any((store.root / "tmp").iterdir())


def test_snapshot_of_a_live_session_while_it_appends(store) -> None:
    s = store.create("live", "tiny", kv_dtype="fp8", options=SessionOptions(commit_every=1))
    s.generate(PROMPT, 3)
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        try:
            while not stop.is_set():
                s.generate(None, 2)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    try:
        for i in range(5):
            snap = store.snapshot("live")
            assert snap.header.committed_end() == 40 + snap.committed * snap.header.record_bytes
            store.fork("live", f"copy{i}")
    finally:
        stop.set()
        t.join()
    s.close()
    assert not errors
    full = store.history("live")
    for i in range(5):
        h = store.history(f"copy{i}")
        assert full[:len(h) - 1] == h[:-1]


def test_adopt_dir_verifies_and_installs(store) -> None:
    _make(store, "src")
    tmp = store.directory.tmp_dir()
    for f in files_of(store, "src"):
        (tmp / f.name).write_bytes(f.read_bytes())
    info = store.adopt_dir(tmp, "moved")
    assert info.id == "moved" and read_manifest(store.session_dir("moved") / MANIFEST_NAME).id == "moved"
    s = store.open("moved")
    assert s.resume_report["verified"] == "bit-identical"
    s.close()
    bad = store.directory.tmp_dir()
    for f in files_of(store, "src"):
        (bad / f.name).write_bytes(f.read_bytes())
    raw = bytearray((bad / KV_NAME).read_bytes())
    raw[50] ^= 4
    (bad / KV_NAME).write_bytes(bytes(raw))
    with pytest.raises(CorruptionError):
        store.adopt_dir(bad, "broken")
    assert not store.exists("broken")
    with pytest.raises(FormatError):
        store.adopt_dir(store.root, "x")  # only directories under <root>/tmp/
    again = store.directory.tmp_dir()
    for f in files_of(store, "src"):
        (again / f.name).write_bytes(f.read_bytes())
    with pytest.raises(FormatError, match="already exists"):
        store.adopt_dir(again, "moved")
    live = store.open("moved")
    with pytest.raises(LockedError):
        store.adopt_dir(again, "moved", replace=True)
    live.close()
    store.adopt_dir(again, "moved", replace=True)
    assert store.history("moved") == store.history("src")


def test_common_prefix_over_a_history(store) -> None:
    _make(store, "s", n=3)
    history = store.history("s")  # the committed records' tokens, then the pending one
    snap = store.snapshot("s")
    with open_kv(snap.kv_path) as reader:
        records = [int(t) for t in reader.tokens[:snap.committed]]
    assert records == history[:-1]
    assert common_prefix(records, history + [1, 2]) == len(history) - 1  # all records reused
    assert common_prefix(records, history[:4] + [999 % 260]) == 4
    assert common_prefix(records, history[:3]) == 2  # at least one token is always fed
    assert common_prefix([], [5]) == 0 and common_prefix([1, 2], [3]) == 0


def test_memory_budget_suspends_least_recently_used(tmp_path) -> None:
    probe = SessionStore(tmp_path / "probe")
    p = probe.create("p", "tiny", kv_dtype="fp8")
    p.generate(PROMPT, 4)
    one = p.memory_bytes()
    p.close()
    assert one > 0 and p.memory_bytes() == 0
    store = SessionStore(tmp_path / "root", memory_budget=int(one * 2.5))
    sessions = {}
    for sid in ("a", "b", "c"):
        sessions[sid] = store.create(sid, "tiny", kv_dtype="fp8")
        sessions[sid].generate(PROMPT, 4)
    assert sessions["a"].state == "suspended"  # least recently used went to disk
    assert [s.id for s in store.residency.sessions()] == ["b", "c"]
    assert store.residency.resident_bytes() <= store.residency.budget
    other = SessionStore(tmp_path / "root").open("a")  # its lock was released
    other.close()
    out = sessions["a"].generate(None, 2)  # resumes transparently, evicting the LRU one
    assert len(out.tokens) == 2 and sessions["a"].state == "resident"
    assert sessions["b"].state == "suspended"
    for s in sessions.values():
        s.close()
    assert store.residency.sessions() == []


def test_not_a_store(tmp_path) -> None:
    with pytest.raises(NotFoundError):
        SessionStore(tmp_path / "missing", create=False)
    with pytest.raises(InvalidSessionIdError):
        SessionStore(tmp_path).session_dir("..")


def test_context_limit_is_refused_before_any_work(store) -> None:
    from kernels.errors import LimitError

    s = store.create("s", "tiny")
    with pytest.raises(LimitError, match="context"):
        s.generate(PROMPT, 5000)
    assert s.cache.length == 0 and s.committed == 0
    s.generate(PROMPT, 2)
    s.close()
    assert store.info("s").tokens == len(PROMPT) + 1


def test_suspended_sessions_cost_disk_only(store) -> None:
    """Suspended sessions hold no descriptor, mapping or cache: only their files."""
    gc.collect()  # earlier tests' stores (each with its catalogue's descriptors) go now, not mid-count
    assert store.catalogue.opened  # the store's own descriptors (FORMAT.md 5.9), open before the count
    fds_before = len(os.listdir("/proc/self/fd"))
    sessions = [store.create(f"s{i}", "tiny", kv_dtype="fp8") for i in range(12)]
    for s in sessions:
        s.generate(PROMPT, 2)
    assert len(os.listdir("/proc/self/fd")) >= fds_before + 12  # resident: lock + kv + sidecar fds
    for s in sessions:
        s.suspend()
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 1
    assert all(s.cache is None and s.memory_bytes() == 0 for s in sessions)
    assert store.residency.sessions() == []
    assert sum(i.bytes for i in store.directory.list()) > 0
