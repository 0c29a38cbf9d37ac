"""No debris (issue 9.4): temporaries name their owner, and a sweep removes those no live process
owns when a store is opened for writing, before rm/fork, and beside an export's or a convert's
destination. Unit rules first; then real SIGKILLs of real ``coli-kv`` processes mid-operation."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sessionstore import log as store_log
from sessionstore.kvfile import sweep
from sessionstore.kvfile.convert import convert_file
from sessionstore.kvfile.header import Dims
from sessionstore.kvfile.sweep import SWEEP_GRACE_S, Owner, current_owner
from sessionstore.kvfile.verify import verify_file
from sessionstore.kvfile.writer import KVWriter
from sessionstore.sessions.store import SessionStore
from tests.support.migrate import make_session, synthetic_rows
from tools.coli_kv import main

REPO = Path(__file__).resolve().parents[2]
BIG = Dims(n_layers=8, kv_lora=256, qk_rope=32, index_head_dim=0, n_index_layers=0, vocab=1000)
BIG_N = 4000  # f32 records of BIG: ~37 MB, so each operation runs long enough to be caught


def dead_owner() -> Owner:
    """The owner token of a process that has exited (its pid is free)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = sweep.process_start_time(child.pid)  # read while it runs or as a zombie: either is fine
    child.wait()
    return Owner(child.pid, start or 1, current_owner().boot)


def fill(directory: Path, nbytes: int = 4096) -> Path:
    directory.mkdir()
    (directory / "kv.coli_kv").write_bytes(b"\0" * nbytes)
    return directory


def age(path: Path, seconds: float) -> None:
    """Make ``path`` and everything in it look untouched for ``seconds``."""
    old = time.time() - seconds
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            os.utime(os.path.join(top, name), (old, old), follow_symlinks=False)
    os.utime(path, (old, old), follow_symlinks=False)


@pytest.fixture
def store(tmp_path: Path) -> SessionStore:
    return SessionStore(tmp_path / "store")


def json_events(err: str) -> list[dict]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


# ---- the rules ----------------------------------------------------------------------------------
def test_dead_owners_temporaries_are_swept_and_logged_when_the_store_opens_for_writing(
        store: SessionStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    dead = dead_owner().token
    t = fill(store.tmp_root / f"t-{dead}-abcdefgh", 5000)
    trash = fill(store.tmp_root / f"trash-{dead}-0a1b2c3d-chat", 3000)
    claimed = fill(store.tmp_root / f"sweep-{dead}-0a1b2c3d", 100)  # a sweeper killed half-way
    monkeypatch.setenv("COLI_LOG", "json")
    store_log.reconfigure()
    try:
        reopened = SessionStore(store.root)
        err = capsys.readouterr().err
    finally:
        monkeypatch.setenv("COLI_LOG", "off")
        store_log.reconfigure()
    assert list(store.tmp_root.iterdir()) == []
    assert sorted((s.path, s.bytes) for s in reopened.directory.swept) == sorted(
        [(str(t), 5000), (str(trash), 3000), (str(claimed), 100)])
    swept = [e for e in json_events(err) if e["event"] == "temp.swept"]
    assert sorted(e["path"] for e in swept) == sorted([str(t), str(trash), str(claimed)])
    assert all(e["bytes"] > 0 and "gone" in e["reason"] for e in swept)
    assert any(e["event"] == "store.sweep" and e["bytes"] == 8100 for e in json_events(err))


def test_a_live_owners_temporaries_are_never_swept(store: SessionStore) -> None:
    mine = store.directory.tmp_dir()  # this process: alive
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while (start := sweep.process_start_time(child.pid)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        theirs = fill(store.tmp_root / f"t-{Owner(child.pid, start or 0, current_owner().boot).token}-x1y2z3w4")
        age(theirs, 10 * SWEEP_GRACE_S)  # however old: its owner lives
        reused = fill(store.tmp_root / f"t-{os.getpid()}-{current_owner().start + 1}-{current_owner().boot}-reused00")
        assert SessionStore(store.root).directory.swept[0].path == str(reused)  # a reused pid is not the owner
        assert sorted(p.name for p in store.tmp_root.iterdir()) == sorted([mine.name, theirs.name])
    finally:
        child.kill()
        child.wait()
    assert [s.path for s in SessionStore(store.root).directory.swept] == [str(theirs)]  # now it is dead
    assert [p.name for p in store.tmp_root.iterdir()] == [mine.name]


def test_ownerless_and_foreign_temporaries_wait_out_the_grace_period(store: SessionStore) -> None:
    legacy = fill(store.tmp_root / "t-ab_cd123")  # mkdtemp's name of older versions
    legacy_trash = fill(store.tmp_root / "trash-chat-0a1b2c3d")
    other_boot = "f" * 8 if current_owner().boot != "f" * 8 else "e" * 8
    foreign = fill(store.tmp_root / f"t-{os.getpid()}-{current_owner().start}-{other_boot}-aaaaaaaa")
    assert SessionStore(store.root).directory.swept == []
    for p in (legacy, legacy_trash, foreign):
        age(p, SWEEP_GRACE_S + 60)
    swept = SessionStore(store.root).directory.swept
    assert sorted(s.path for s in swept) == sorted(map(str, (legacy, legacy_trash, foreign)))
    assert all("untouched for" in s.reason for s in swept)


def test_names_not_ours_symlinks_and_read_only_opens_are_left_alone(
        store: SessionStore, tmp_path: Path) -> None:
    outside = fill(tmp_path / "outside")
    dead = dead_owner().token
    (store.tmp_root / "notes.txt").write_text("mine")
    (store.tmp_root / f"t-{dead}-linklink").symlink_to(outside)
    debris = fill(store.tmp_root / f"t-{dead}-realreal")
    assert SessionStore(store.root, create=False).directory.swept == []  # ls, export: read only
    assert main(["ls", "--root", str(store.root)]) == 0
    assert debris.exists()
    swept = SessionStore(store.root).directory.swept
    assert [s.path for s in swept] == [str(debris)]
    assert (store.tmp_root / "notes.txt").read_text() == "mine"
    assert (store.tmp_root / f"t-{dead}-linklink").is_symlink()
    assert (outside / "kv.coli_kv").stat().st_size == 4096


def test_a_replaced_session_is_kept_while_it_is_the_only_copy(store: SessionStore) -> None:
    dead = dead_owner().token
    only = fill(store.tmp_root / f"replaced-{dead}-0a1b2c3d-chat")
    assert SessionStore(store.root).directory.swept == [] and only.exists()
    make_session(store, "chat", 3)  # the replacement landed: the old copy is debris now
    assert [s.path for s in SessionStore(store.root).directory.swept] == [str(only)]


def test_rm_and_fork_sweep_before_they_write(store: SessionStore, capsys: pytest.CaptureFixture[str]) -> None:
    make_session(store, "chat", 4)
    dead = dead_owner().token
    for argv in (["fork", "--root", str(store.root), "chat", "chat2"],
                 ["rm", "--root", str(store.root), "chat2"]):
        fill(store.tmp_root / f"t-{dead}-{argv[0]:_<8}")
        assert main(argv) == 0, capsys.readouterr().err
        assert list(store.tmp_root.iterdir()) == []


def test_export_and_convert_sweep_dead_temporaries_beside_their_destination(
        store: SessionStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_session(store, "chat", 6)
    out = tmp_path / "out"
    out.mkdir()
    dest = out / "chat.colibundle"
    dead, live = dead_owner().token, current_owner().token
    stale = [out / f"chat.colibundle.{dead}-0a1b2c3d.partial", out / "chat.colibundle.0a1b2c3d.partial"]
    keep = [out / f"chat.colibundle.{live}-0a1b2c3d.partial", out / f"other.colibundle.{dead}-0a1b2c3d.partial"]
    for p in stale + keep:
        p.write_bytes(b"half a bundle")
    age(stale[1], SWEEP_GRACE_S + 60)  # an ownerless partial of an older version, long untouched
    assert main(["export", "--root", str(store.root), "chat", str(dest)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sorted([dest.name] + [p.name for p in keep])

    src = store.kv_path("chat")
    dst = tmp_path / "conv.coli_kv"
    (tmp_path / f"conv.coli_kv.{dead}-0a1b2c3d.tmp").write_bytes(b"half a file")
    (tmp_path / f"conv.coli_kv.{live}-0a1b2c3d.tmp").write_bytes(b"a live convert's")
    convert_file(src, dst, "v1")
    assert sorted(p.name for p in tmp_path.glob("conv.coli_kv*")) == sorted(
        ["conv.coli_kv", "conv.coli_kv.colisum", f"conv.coli_kv.{live}-0a1b2c3d.tmp"])


# ---- real SIGKILLs of real coli-kv processes ----------------------------------------------------
def coli_kv(*argv: str, **kwargs: object) -> subprocess.Popen:
    env = {**os.environ, "COLI_LOG": "off"}
    return subprocess.Popen([sys.executable, "-m", "tools", *argv], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kwargs)  # type: ignore[call-overload]


def kill_when(proc: subprocess.Popen, seen: Callable[[], list[Path]], timeout: float = 60) -> list[Path]:
    """SIGKILL ``proc`` the moment ``seen()`` finds its temporaries; returns what was there
    (empty if the process ended first)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        found = seen()
        if found:
            proc.kill()
            proc.wait()
            assert proc.returncode == -signal.SIGKILL
            return found
        time.sleep(0.0005)
    proc.wait()
    return []


def big_session(store: SessionStore, session_id: str = "big") -> None:
    make_session(store, session_id, BIG_N, kv_dtype="f32", dims=BIG)


def store_temporaries(store: SessionStore) -> Callable[[], list[Path]]:
    return lambda: sorted(store.tmp_root.glob("t-*"))


def kill_until_caught(start: Callable[[], subprocess.Popen], seen: Callable[[], list[Path]],
                      undo: Callable[[], None], tries: int = 6) -> list[Path]:
    """Start, kill mid-operation; a run that finished before it was seen is undone and retried."""
    for _ in range(tries):
        found = kill_when(start(), seen)
        if found:
            return found
        undo()
    pytest.fail(f"the operation always finished before its temporaries were seen ({tries} tries)")


def test_a_killed_import_leaves_a_temp_dir_the_next_writer_sweeps(tmp_path: Path) -> None:
    source = SessionStore(tmp_path / "A")
    big_session(source)
    bundle = tmp_path / "big.colibundle"
    assert main(["export", "--root", str(source.root), "big", str(bundle), "--compress", "none"]) == 0
    data = bundle.read_bytes()
    target = SessionStore(tmp_path / "B")
    proc = coli_kv("import", "--root", str(target.root), "-", stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(data[:len(data) // 2])  # triggered: half the bundle is in, the rest never comes
    proc.stdin.flush()
    found = kill_when(proc, store_temporaries(target))
    proc.stdin.close()
    assert found and sum(f.stat().st_size for f in found[0].iterdir()) > 0
    assert main(["import", "--root", str(target.root), str(bundle)]) == 0  # the store used again
    assert list(target.tmp_root.iterdir()) == []
    assert target.directory.ids() == ["big"] and verify_file(target.kv_path("big")).sound


def test_a_killed_fork_leaves_a_temp_dir_the_next_writer_sweeps(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "S")
    big_session(store)
    found = kill_until_caught(lambda: coli_kv("fork", "--root", str(store.root), "big", "copy"),
                              store_temporaries(store), lambda: store.delete("copy"))
    assert found[0].exists()
    assert main(["fork", "--root", str(store.root), "big", "copy"]) == 0
    assert list(store.tmp_root.iterdir()) == []
    assert store.directory.ids() == ["big", "copy"] and verify_file(store.kv_path("copy")).sound


def test_a_killed_export_leaves_a_partial_the_next_export_sweeps(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "S")
    big_session(store)
    out = tmp_path / "out"
    out.mkdir()
    dest = out / "big.colibundle"
    found = kill_until_caught(lambda: coli_kv("export", "--root", str(store.root), "big", str(dest)),
                              lambda: sorted(out.glob("*.partial")), lambda: dest.unlink())
    assert found[0].exists() and not dest.exists()
    assert main(["export", "--root", str(store.root), "big", str(dest)]) == 0
    assert [p.name for p in out.iterdir()] == [dest.name]


def test_a_killed_convert_leaves_a_temp_the_next_convert_sweeps(tmp_path: Path) -> None:
    src = tmp_path / "src.coli_kv"
    with KVWriter.open(src, BIG, kv_dtype="f32") as writer:
        writer.append(synthetic_rows(BIG_N, BIG, 3))
        writer.commit()
    dst = tmp_path / "dst.coli_kv"

    def undo() -> None:
        for p in tmp_path.glob("dst.coli_kv*"):
            p.unlink()

    found = kill_until_caught(lambda: coli_kv("convert", str(src), str(dst), "--to", "v2"),
                              lambda: sorted(tmp_path.glob("dst.coli_kv.*.tmp")), undo)
    assert found[0].exists()
    assert main(["convert", str(src), str(dst), "--to", "v2"]) == 0
    assert sorted(p.name for p in tmp_path.glob("dst.coli_kv*")) == ["dst.coli_kv", "dst.coli_kv.colisum"]
    assert verify_file(dst).sound
