"""The session catalogue (FORMAT.md 5.9): rebuilt identical when deleted, consistent after a real
SIGKILL mid-write, intents replayed and outside changes seen on open, a session whose files are
gone reported and never served, and paging that covers every session exactly once."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernels.errors import FormatError, LimitError
from sessionstore.kvfile.sweep import current_owner
from sessionstore.sessions.catalogue import RACY_S, Catalogue, SessionFilesMissingError
from sessionstore.sessions.catalogue_entry import entry_from_files
from sessionstore.sessions.catalogue_schema import CATALOGUE_NAME
from sessionstore.sessions.paths import InvalidSessionIdError
from sessionstore.sessions.store import SessionStore
from tests.support.session_util import REPO
from tools.coli_kv import main

PROMPT = list(b"catalogue")


def _store_with(root: Path, n_forks: int) -> SessionStore:
    """A store of one created session ``base`` (two turns, so it was committed and resumed) and
    ``n_forks`` forks of it ``f000``..., some cut short."""
    store = SessionStore(root)
    s = store.create("base", "tiny")
    s.generate(PROMPT, 3)
    s.suspend()
    s.generate(PROMPT + [1, 2], 2)
    s.close()
    for i in range(n_forks):
        store.fork("base", f"f{i:03d}", at=None if i % 3 else 4)
    return store


def _files_truth(store: SessionStore) -> list[object]:
    """Every session as its files describe it now (what a rebuild would list)."""
    names = sorted(n for n in os.listdir(store.sessions_root))
    return [entry_from_files(store.sessions_root, sid) for sid in names]


def _drop_catalogue(root: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        try:
            os.unlink(root / (CATALOGUE_NAME + suffix))
        except FileNotFoundError:
            pass


def _age_stamp(store: SessionStore) -> None:
    """Make the stamp trustworthy now (as if the last change was RACY_S ago), so that an open
    takes the fast path unless something changed."""
    db = sqlite3.connect(store.root / CATALOGUE_NAME)
    mtime = os.lstat(store.sessions_root).st_mtime_ns
    db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                   [("sessions_mtime_ns", str(mtime)), ("stamped_at", repr(mtime / 1e9 + RACY_S + 1))])
    db.commit()
    db.close()


def test_a_deleted_catalogue_is_rebuilt_identical(tmp_path: Path) -> None:
    store = _store_with(tmp_path / "root", 5)
    store.delete("f001")
    live = store.open("f002")
    live.generate(None, 2)  # committed by a resident session: the row follows the commit
    live.close()
    before = store.catalogue.entries()
    assert [e.id for e in before] == ["base", "f000", "f002", "f003", "f004"]
    assert before == _files_truth(store)  # what the store's own writes recorded = the files
    assert all(e.state == "suspended" and e.holder is None for e in before)
    del store, live
    _drop_catalogue(tmp_path / "root")
    again = SessionStore(tmp_path / "root")
    assert again.catalogue.opened == "rebuilt"
    assert again.catalogue.entries() == before
    _age_stamp(again)
    third = SessionStore(tmp_path / "root")  # a plain restart: the fast path, the same rows
    assert third.catalogue.opened == "fresh" and third.catalogue.entries() == before


def test_a_resident_session_is_listed_resident_until_released(tmp_path: Path) -> None:
    store = _store_with(tmp_path / "root", 1)
    s = store.open("f000")
    page = store.page(10)
    assert {e.id: e.state for e in page.entries} == {"base": "suspended", "f000": "resident"}
    assert store.catalogue.get("f000").holder == current_owner().token
    s.close()
    assert {e.id: e.state for e in store.page(10).entries} == {"base": "suspended", "f000": "suspended"}


def test_a_damaged_catalogue_is_moved_aside_and_rebuilt(tmp_path: Path) -> None:
    store = _store_with(tmp_path / "root", 2)
    before = store.catalogue.entries()
    store.catalogue.close()
    _drop_catalogue(tmp_path / "root")
    (tmp_path / "root" / CATALOGUE_NAME).write_bytes(b"not a database" * 100)
    again = SessionStore(tmp_path / "root")
    assert again.catalogue.opened == "rebuilt" and again.catalogue.entries() == before
    assert (tmp_path / "root" / (CATALOGUE_NAME + ".damaged")).read_bytes().startswith(b"not a database")


def test_an_intent_left_by_a_dead_process_is_replayed(tmp_path: Path) -> None:
    """A process that died between its rename and its catalogue row left an intent: the next
    open re-reads that session even though the stamp says nothing else changed."""
    store = _store_with(tmp_path / "root", 1)
    shutil.copytree(store.session_dir("f000"), store.sessions_root / "late")
    manifest = store.read_manifest("f000")  # make the copy a valid session named "late"
    manifest.id = "late"
    from sessionstore.sessions.manifest import MANIFEST_NAME, write_manifest

    write_manifest(store.sessions_root / "late" / MANIFEST_NAME, manifest)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    token = f"{dead.stdout.strip()}-1-{current_owner().boot}"
    db = sqlite3.connect(store.root / CATALOGUE_NAME)
    db.execute("INSERT INTO intents (id, owner) VALUES (?, ?)", ("late", token))
    db.commit()
    db.close()
    _age_stamp(store)
    again = SessionStore(tmp_path / "root")
    assert again.catalogue.opened == "replayed" and again.catalogue.replayed == ["late"]
    assert again.catalogue.get("late") == entry_from_files(again.sessions_root, "late")
    assert not sqlite3.connect(again.root / CATALOGUE_NAME).execute("SELECT * FROM intents").fetchall()


def test_a_change_behind_the_catalogues_back_is_seen_on_open(tmp_path: Path) -> None:
    """A session directory removed or added without the store (an older version, a manual copy)
    changes ``sessions/``'s mtime: the open compares names; the removed one is reported missing."""
    store = _store_with(tmp_path / "root", 2)
    _age_stamp(store)
    assert SessionStore(tmp_path / "root").catalogue.opened == "fresh"
    shutil.rmtree(store.session_dir("f000"))
    shutil.copytree(store.session_dir("f001"), store.sessions_root / "f001-copy")  # manifest id differs
    again = SessionStore(tmp_path / "root")
    assert again.catalogue.opened == "reconciled"
    assert again.catalogue.get("f000").state == "missing"
    assert again.catalogue.get("f001-copy").state == "unreadable"  # its manifest names f001


def test_a_session_added_behind_a_running_stores_back_is_listed_at_the_next_page(tmp_path: Path) -> None:
    store = _store_with(tmp_path / "root", 1)
    assert [e.id for e in store.page(10).entries] == ["base", "f000"]
    time.sleep(0.05)  # past the timestamp tick of the store's own last change
    other = SessionStore(tmp_path / "elsewhere")
    s = other.create("moved-in", "tiny")
    s.generate(PROMPT, 2)
    s.close()
    shutil.copytree(other.session_dir("moved-in"), store.sessions_root / "moved-in")  # not through the store
    page = store.page(10)
    assert [e.id for e in page.entries] == ["base", "f000", "moved-in"]
    assert page.entries[-1] == entry_from_files(store.sessions_root, "moved-in")


def test_a_session_whose_files_are_gone_is_reported_never_served(tmp_path: Path, capsys) -> None:
    store = _store_with(tmp_path / "root", 2)
    shutil.rmtree(store.session_dir("f000"))
    entries = {e.id: e for e in store.page(10).entries}
    assert entries["f000"].state == "missing" and "gone" in (entries["f000"].error or "")
    assert entries["f001"].state == "suspended"
    with pytest.raises(SessionFilesMissingError, match="catalogue but its files are gone"):
        store.open("f000", "tiny")
    with pytest.raises(SessionFilesMissingError):
        store.create("f000", "tiny")  # never silently made anew under the same id
    assert not store.exists("f000")
    assert main(["ls", "--root", str(store.root), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s["id"] for s in listing["sessions"]] == ["base", "f001"]
    assert [(u["id"], u["state"]) for u in listing["unreadable"]] == [("f000", "missing")]
    again = SessionStore(tmp_path / "root")  # still reported after a restart
    assert again.catalogue.get("f000").state == "missing"
    assert main(["rm", "--root", str(store.root), "f000"]) == 0  # the operator drops it
    capsys.readouterr()
    assert SessionStore(tmp_path / "root").catalogue.get("f000") is None
    again.create("f000", "tiny").close()  # the id is free again


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_paging_covers_every_session_exactly_once(tmp_path: Path, order: str) -> None:
    store = _store_with(tmp_path / "root", 22)
    expected = sorted(store.directory.ids(), reverse=order == "desc")
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        page = store.page(5, after, order)
        pages += 1
        seen += [e.id for e in page.entries]
        if not page.has_more:
            break
        after = page.entries[-1].id
        if pages == 2:  # the cursor's session deleted between pages: the next page still follows it
            store.delete(after)
            expected.remove(after)
            seen.remove(after)
    assert seen == expected and len(set(seen)) == len(seen)
    assert pages == 5  # 23 sessions (one deleted after it was listed), 5 per page
    assert store.page(1000, order=order).entries[0].id == expected[0]


def test_bad_page_arguments_are_one_clear_error(tmp_path: Path, capsys) -> None:
    store = _store_with(tmp_path / "root", 1)
    for limit in (0, -1, 1001, True):
        with pytest.raises(LimitError, match="limit must be an integer from 1 to 1000"):
            store.page(limit)
    with pytest.raises(FormatError, match="order must be one of asc, desc"):
        store.page(5, order="sideways")
    with pytest.raises(InvalidSessionIdError):
        store.page(5, after="../x")
    for argv in (["--limit", "0"], ["--after", "a/b"]):
        assert main(["ls", "--root", str(store.root), *argv]) != 0
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert main(["ls", "--root", str(store.root), "--limit", "1", "--order", "desc", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s["id"] for s in out["sessions"]] == ["f000"] and out["has_more"] and out["last_id"] == "f000"


_WRITER = r"""
import sys
from sessionstore.sessions.store import SessionStore

store = SessionStore(sys.argv[1])
i = 0
while True:  # forks, deletes and commit notes: every kind of catalogue write, as fast as it goes
    sid = f"k{sys.argv[2]}-{i:05d}"
    store.fork("base", sid)
    if i % 3 == 0:
        store.delete(sid)
    for _ in range(5):
        store.note_session(store.read_manifest("base"), resident=True)
    print(i, flush=True)
    i += 1
"""


def test_kill_9_mid_catalogue_write_leaves_a_catalogue_that_opens_and_matches(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _store_with(root, 0)
    env = {**os.environ, "COLI_LOG": "off", "PYTHONPATH": str(REPO)}
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root), str(round_)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None
        for _ in range(4 + 3 * round_):  # a few operations in, then killed wherever it is
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.003 * round_)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()
        db = sqlite3.connect(root / CATALOGUE_NAME)
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        db.close()
        store = SessionStore(root)  # sweeps the killed fork's temp dir; replays or reconciles
        assert store.catalogue.opened in ("replayed", "reconciled")
        listed = [e for e in store.catalogue.entries() if e.state != "missing"]
        truth = _files_truth(store)
        assert [e.id for e in listed] == [e.id for e in truth if e is not None]
        for entry in listed:  # a row left "resident" by the killed writer is the only difference
            fresh = entry_from_files(store.sessions_root, entry.id)
            assert fresh is not None and entry.same_files(fresh), (entry, fresh)
        assert [e.id for e in store.page(1000).entries] == [e.id for e in listed]


@pytest.mark.parametrize("taken_by", ["directory", "symlink", "wal symlink"])
def test_a_store_that_cannot_hold_the_file_lists_from_memory(tmp_path: Path, taken_by: str) -> None:
    """The catalogue's name taken by a directory, or the file or its WAL a symlink out of the
    store: never followed; the catalogue is built in memory from the files."""
    store = _store_with(tmp_path / "root", 2)
    before = store.catalogue.entries()
    store.catalogue.close()
    _drop_catalogue(tmp_path / "root")
    outside = tmp_path / "outside.db"
    if taken_by == "directory":
        os.mkdir(tmp_path / "root" / CATALOGUE_NAME)
    else:
        os.symlink(outside, tmp_path / "root" / (CATALOGUE_NAME + ("" if taken_by == "symlink" else "-wal")))
    cat = Catalogue(store.root, store.sessions_root)
    assert cat.opened == "rebuilt" and cat.entries() == before
    assert not outside.exists()


def test_a_symlinked_session_directory_is_listed_unreadable_never_followed(tmp_path: Path) -> None:
    store = _store_with(tmp_path / "root", 1)
    outside = tmp_path / "outside"
    shutil.copytree(store.session_dir("f000"), outside)
    os.symlink(outside, store.sessions_root / "f000-link")
    again = SessionStore(tmp_path / "root")
    entry = again.catalogue.get("f000-link")
    assert entry is not None and entry.state == "unreadable" and "symlink" in (entry.error or "")


def test_a_fresh_open_and_a_page_read_no_more_than_the_page(tmp_path: Path, monkeypatch) -> None:
    """The cost rule, counted: opening a store whose catalogue is fresh lists no directory and
    reads no manifest; a page reads its own sessions' manifests only."""
    store = _store_with(tmp_path / "root", 30)
    _age_stamp(store)
    import sessionstore.sessions.catalogue_entry as entry_module  # where the rows are read from the files

    reads: list[str] = []
    listdirs: list[str] = []
    real_read, real_listdir = entry_module.read_manifest, os.listdir
    monkeypatch.setattr(entry_module, "read_manifest", lambda p: reads.append(str(p)) or real_read(p))
    monkeypatch.setattr(os, "listdir", lambda p=".": listdirs.append(str(p)) or real_listdir(p))
    again = SessionStore(tmp_path / "root", sweep=False)
    assert again.catalogue.opened == "fresh" and reads == [] and str(again.sessions_root) not in listdirs
    page = again.page(4, after="f010", order="desc")
    assert [e.id for e in page.entries] == ["f009", "f008", "f007", "f006"]
    assert sorted(Path(p).parent.name for p in reads) == ["f006", "f007", "f008", "f009"]
    assert str(again.sessions_root) not in listdirs


_STALLED = r"""
import os, sys, time
from sessionstore.sessions.catalogue_db import CatalogueDb
from sessionstore.sessions.store import SessionStore

root, where = sys.argv[1], sys.argv[2]
store = SessionStore(root)
assert store.catalogue.opened  # opened (and brought up to date) before the seam is set
real_stamp = CatalogueDb.stamp


def stall(self, *args):  # inside the change's (or the rebuild's) transaction, before its COMMIT
    real_stamp(self, *args)
    print("in transaction", flush=True)
    time.sleep(120)


CatalogueDb.stamp = stall
if where == "fork":
    store.fork("base", "forked")
elif where == "delete":
    store.delete("f000")
else:
    store.catalogue.rebuild()
"""


@pytest.mark.parametrize("where", ["fork", "delete", "rebuild"])
def test_kill_9_inside_a_catalogue_transaction(tmp_path: Path, where: str) -> None:
    """A writer SIGKILLed inside its catalogue transaction (the row written, the COMMIT not): the
    transaction is gone, the catalogue opens, and the change's intent makes the next open re-read
    that session, so the listing matches the files."""
    root = tmp_path / "root"
    before = _store_with(root, 2).catalogue.entries()
    env = {**os.environ, "COLI_LOG": "off", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _STALLED, str(root), where], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    assert line == b"in transaction\n", proc.stderr.read()
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.stdout.close()
    proc.stderr.close()
    db = sqlite3.connect(root / CATALOGUE_NAME)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = [r[0] for r in db.execute("SELECT id FROM sessions ORDER BY id")]
    assert rows == [e.id for e in before]  # the killed transaction left nothing behind
    db.close()
    store = SessionStore(root)
    assert store.catalogue.replayed == {"fork": ["forked"], "delete": ["f000"], "rebuild": []}[where]
    assert store.catalogue.entries() == _files_truth(store)
    expected = {"fork": ["base", "f000", "f001", "forked"], "delete": ["base", "f001"],
                "rebuild": ["base", "f000", "f001"]}[where]
    assert [e.id for e in store.page(10).entries] == expected


def test_a_page_never_resurrects_a_session_deleted_while_it_was_read(tmp_path: Path, monkeypatch) -> None:
    """A delete that completes while a page re-reads that session from its files (a server lists
    on one thread and deletes on another): the page reports it gone, and its write-back does not
    put a "missing" row back, which would refuse the id for good."""
    store = _store_with(tmp_path / "root", 2)
    import sessionstore.sessions.catalogue as catalogue_module

    real = entry_from_files

    def racing(sessions_root: Path, session_id: str):  # CatalogueEntry | None
        if session_id == "f001":
            store.delete("f001")  # rename and catalogue row, between the page's query and its read
        return real(sessions_root, session_id)

    monkeypatch.setattr(catalogue_module, "entry_from_files", racing)
    page = store.page(10)
    assert {e.id: e.state for e in page.entries} == {"base": "suspended", "f000": "suspended", "f001": "missing"}
    monkeypatch.setattr(catalogue_module, "entry_from_files", real)
    assert store.catalogue.get("f001") is None and [e.id for e in store.page(10).entries] == ["base", "f000"]
    store.create("f001", "tiny").close()  # the id is free


def test_a_catalogue_busy_past_the_timeout_is_not_taken_for_damaged(tmp_path: Path, monkeypatch) -> None:
    """Another process holding the write lock past the busy timeout: the store opens with an
    in-memory catalogue built from the files; the file is not moved aside."""
    import sessionstore.sessions.catalogue_schema as schema_module  # where the connection is made

    store = _store_with(tmp_path / "root", 2)
    before = store.catalogue.entries()
    monkeypatch.setattr(schema_module, "BUSY_TIMEOUT_MS", 200)
    holder = sqlite3.connect(store.root / CATALOGUE_NAME, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # the write lock, held
    try:
        again = SessionStore(tmp_path / "root")
        assert again.catalogue.opened == "rebuilt"  # its stamp is recent: the open must write (reconcile)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert again.catalogue.opened == "rebuilt" and again.catalogue.entries() == before
    assert not (tmp_path / "root" / (CATALOGUE_NAME + ".damaged")).exists()


def _summed(store: SessionStore) -> dict[str, int]:
    """The bytes by state summed over every row (the full scan the running totals replace)."""
    out: dict[str, int] = {}
    for e in store.catalogue.entries():
        out[e.state] = out.get(e.state, 0) + e.bytes
    return out


def test_the_running_totals_follow_every_change_and_a_format_3_catalogue_gets_them_in_place(tmp_path: Path) -> None:
    store = _store_with(tmp_path / "root", 4)
    assert store.catalogue.bytes_by_state() == _summed(store) and _summed(store)
    s = store.open("f001")  # resident (an upsert), a commit's note, a truncate, a release
    s.generate(PROMPT + [7], 3)
    assert store.catalogue.bytes_by_state() == _summed(store)
    s.close()
    store.delete("f002")  # a row deleted; a fork inserted through an intent and INSERT OR REPLACE
    store.fork("base", "late")
    shutil.rmtree(store.session_dir("f000"))  # missing: a reconcile's UPDATE
    store.catalogue.reconcile()
    assert store.catalogue.bytes_by_state() == _summed(store)
    assert "missing" in store.catalogue.bytes_by_state()  # moved by the UPDATE, off the local states
    store.catalogue.rebuild()
    assert store.catalogue.bytes_by_state() == _summed(store)

    expected = _summed(store)
    store.catalogue.close()
    db = sqlite3.connect(tmp_path / "root" / CATALOGUE_NAME)  # the format before the totals
    db.executescript("DROP TRIGGER totals_insert; DROP TRIGGER totals_delete; DROP TRIGGER totals_update; "
                     "DROP TABLE totals; PRAGMA user_version = 3;")
    db.close()
    again = SessionStore(tmp_path / "root")
    assert again.catalogue.bytes_by_state() == expected == _summed(again)
    assert not (tmp_path / "root" / (CATALOGUE_NAME + ".damaged")).exists()  # upgraded, not moved aside
