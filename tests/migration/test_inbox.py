"""The inbox watcher: bundles present at start and landing later are imported, failures are
moved aside with a reason, partial files are never touched, SIGTERM exits cleanly."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sessionstore.migration import export_session
from sessionstore.migration.inbox import Inbox
from sessionstore.migration.transport import open_sink
from sessionstore.sessions.store import SessionStore
from tests.support.migrate import make_session, tree_state

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def source(tmp_path):
    store = SessionStore(tmp_path / "src")
    for i, sid in enumerate(("alpha", "beta", "gamma")):
        make_session(store, sid, 10 + i, seed=i)
    return store


def bundle_bytes(store, sid) -> bytes:
    sink = io.BytesIO()
    export_session(store, sid, sink)
    return sink.getvalue()


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def test_drain_imports_good_bundles_and_moves_bad_ones_aside(tmp_path, source):
    inbox_dir = tmp_path / "inbox"
    inbox_dir.mkdir()
    (inbox_dir / "alpha.colibundle").write_bytes(bundle_bytes(source, "alpha"))
    bad = bytearray(bundle_bytes(source, "beta"))
    bad[len(bad) // 2] ^= 0xFF
    (inbox_dir / "beta.colibundle").write_bytes(bytes(bad))
    (inbox_dir / "gamma.colibundle.partial").write_bytes(bundle_bytes(source, "gamma")[:100])
    target = SessionStore(tmp_path / "dst")
    inbox = Inbox(target, inbox_dir)
    assert inbox.scan() == 2
    outcomes = {o.name: o for o in inbox.drain()}
    assert outcomes["alpha.colibundle"].ok and outcomes["alpha.colibundle"].tokens == 10
    assert not outcomes["beta.colibundle"].ok
    assert target.directory.ids() == ["alpha"]
    assert (inbox_dir / "done" / "alpha.colibundle").is_file()
    assert (inbox_dir / "failed" / "beta.colibundle").is_file()
    reason = (inbox_dir / "failed" / "beta.colibundle.reason").read_text()
    assert "CorruptionError" in reason or "FormatError" in reason
    assert (inbox_dir / "gamma.colibundle.partial").is_file()  # never touched
    assert list(target.tmp_root.iterdir()) == []


def test_a_second_bundle_for_an_existing_id_fails_without_replace(tmp_path, source):
    inbox_dir = tmp_path / "inbox"
    inbox_dir.mkdir()
    data = bundle_bytes(source, "alpha")
    target = SessionStore(tmp_path / "dst")
    inbox = Inbox(target, inbox_dir)
    (inbox_dir / "a1").write_bytes(data)
    inbox.scan()
    inbox.drain()
    before = tree_state(target.root)
    (inbox_dir / "a2").write_bytes(data)
    inbox.scan()
    [outcome] = inbox.drain()
    assert not outcome.ok and "already exists" in outcome.reason
    assert tree_state(target.root) == before
    (inbox_dir / "done" / "a1").rename(inbox_dir / "a3")
    replacing = Inbox(target, inbox_dir, replace=True)
    replacing.scan()
    assert [o.ok for o in replacing.drain()] == [True]


def test_run_imports_what_is_there_and_what_lands_later(tmp_path, source):
    inbox_dir = tmp_path / "inbox"
    inbox_dir.mkdir()
    (inbox_dir / "alpha.colibundle").write_bytes(bundle_bytes(source, "alpha"))
    target = SessionStore(tmp_path / "dst")
    inbox = Inbox(target, inbox_dir)
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=inbox.run, args=(stop,), kwargs={"ready": ready})
    thread.start()
    try:
        assert ready.wait(10)
        # a writer that follows the convention: <name>.partial then a rename
        with open_sink(str(inbox_dir / "beta.colibundle")) as (sink, _):
            export_session(source, "beta", sink)
        # a plain copy (written in place, then closed)
        shutil.copyfile(_export_file(source, "gamma", tmp_path), inbox_dir / "gamma.colibundle")
        wait_for(lambda: len(inbox.outcomes) >= 3)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert sorted(target.directory.ids()) == ["alpha", "beta", "gamma"]
    assert all(o.ok for o in inbox.outcomes)
    assert sorted(p.name for p in (inbox_dir / "done").iterdir()) == [
        "alpha.colibundle", "beta.colibundle", "gamma.colibundle"]


def _export_file(store, sid, tmp_path) -> Path:
    path = tmp_path / f"{sid}.out"
    path.write_bytes(bundle_bytes(store, sid))
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_process_imports_logs_and_exits_cleanly_on_signal(tmp_path, source, sig):
    inbox_dir = tmp_path / "inbox"
    inbox_dir.mkdir()
    (inbox_dir / "alpha.colibundle").write_bytes(bundle_bytes(source, "alpha"))
    root = tmp_path / "dst"
    env = {**os.environ, "COLI_LOG": "json"}
    proc = subprocess.Popen([sys.executable, "-m", "tools", "serve", "--root", str(root),
                             "--inbox", str(inbox_dir), "--json"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (inbox_dir / "done" / "alpha.colibundle").exists())
        staged = inbox_dir / "beta.colibundle.partial"
        staged.write_bytes(bundle_bytes(source, "beta"))
        staged.rename(inbox_dir / "beta.colibundle")
        (inbox_dir / "junk.colibundle").write_bytes(b"not a bundle at all")
        wait_for(lambda: (inbox_dir / "done" / "beta.colibundle").exists()
                 and (inbox_dir / "failed" / "junk.colibundle.reason").exists())
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert (summary["imported"], summary["failed"]) == (2, 1)
    events = [json.loads(line)["event"] for line in err.decode().splitlines() if line.startswith("{")]
    for event in ("inbox.start", "inbox.found", "inbox.import_start", "inbox.import_done",
                  "inbox.import_failed", "inbox.stop"):
        assert event in events, (event, events)
    assert sorted(SessionStore(root).directory.ids()) == ["alpha", "beta"]


def test_serve_once(tmp_path, source, capsys):
    from tools.coli_kv import main

    inbox_dir = tmp_path / "inbox"
    inbox_dir.mkdir()
    (inbox_dir / "gamma.colibundle").write_bytes(bundle_bytes(source, "gamma"))
    assert main(["serve", "--root", str(tmp_path / "dst"), "--inbox", str(inbox_dir), "--once",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["imported"] == 1 and summary["outcomes"][0]["session_id"] == "gamma"
