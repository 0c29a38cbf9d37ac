"""A failed command leaves a store every command accepts (issue 9.3).

The empty-store cleanup never removes a part of a store that holds anything; a missing ``tmp/``
beside a real ``sessions/`` is recreated. The proof: ENOSPC on a small tmpfs during the first
``generate`` of a new root (mounting needs root; skipped with the reason where it is refused).
"""
from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sessionstore.kvfile.verify import verify_file
from sessionstore.sessions.store import SessionStore
from tests.support.migrate import make_session
from tools._common import remove_empty_store
from tools.coli_kv import main

PROMPT = "72,105,33,10"
SAMPLING = ["--temperature", "0.8", "--top-k", "40", "--seed", "7"]


def test_a_missing_tmp_dir_is_recreated_and_every_command_accepts_the_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = SessionStore(tmp_path / "S")
    make_session(store, "chat", 5)
    root = str(store.root)
    for argv in (["ls", "--root", root], ["export", "--root", root, "chat", str(tmp_path / "b")],
                 ["fork", "--root", root, "chat", "copy"], ["rm", "--root", root, "copy"],
                 ["import", "--root", root, str(tmp_path / "b"), "--as", "again"]):
        shutil.rmtree(store.tmp_root)
        assert main(argv) == 0, (argv, capsys.readouterr().err)
        assert store.tmp_root.is_dir()
    assert SessionStore(root, create=False).directory.ids() == ["again", "chat"]


def test_a_root_without_sessions_is_still_not_a_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tmp").mkdir()  # /tmp-like: never made into a store by a read
    assert main(["ls", "--root", str(tmp_path)]) != 0
    assert "not a session store (no sessions/)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]


def test_the_empty_store_cleanup_removes_only_an_empty_skeleton(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "held")
    make_session(store, "chat", 2)
    remove_empty_store(str(store.root))
    assert store.tmp_root.is_dir() and store.directory.ids() == ["chat"]  # nothing of a holding store goes
    busy = SessionStore(tmp_path / "busy")
    other = busy.directory.tmp_dir()  # another command's temp dir, no session yet
    remove_empty_store(str(busy.root))
    assert other.is_dir() and busy.sessions_root.is_dir()
    empty = SessionStore(tmp_path / "empty")
    remove_empty_store(str(empty.root))
    assert not empty.root.exists()


# ---- ENOSPC on a small tmpfs ---------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", str(mnt)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip() or done.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def history(root: Path, session_id: str) -> list[int]:
    return SessionStore(root, create=False).history(session_id)


def test_enospc_in_the_first_generate_leaves_a_store_every_command_accepts_and_resumes_exact(
        small_tmpfs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = tmp_path / "ref"  # the same conversation, uninterrupted, on a roomy disk
    assert main(["generate", "--root", str(ref), "--session", "c", "--model", "tiny", "--kv", "f32",
                 "--prompt-ids", PROMPT, "--max-new", "600", *SAMPLING]) == 0
    expected = history(ref, "c")
    capsys.readouterr()

    root = small_tmpfs / "r"
    argv = ["generate", "--root", str(root), "--session", "c", "--model", "tiny", "--kv", "f32",
            "--prompt-ids", PROMPT, "--max-new", "600", *SAMPLING]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    kv = root / "sessions" / "c" / "kv.coli_kv"
    assert "No space left on device" in err[-1] and str(kv) in err[-1], err[-1]  # names the file
    assert (root / "tmp").is_dir()

    committed = history(root, "c")
    assert 0 < len(committed) < len(expected) and committed == expected[:len(committed)]
    assert verify_file(kv).sound
    assert main(["ls", "--root", str(root), "--json"]) == 0, capsys.readouterr().err
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(s["id"], s["tokens"]) for s in listed["sessions"]] == [("c", len(committed) - 1)]
    assert main(["export", "--root", str(root), "c", str(tmp_path / "c.colibundle")]) == 0, \
        capsys.readouterr().err

    subprocess.run(["mount", "-o", "remount,size=96m", str(small_tmpfs)], check=True, timeout=30)
    for cmd in (["fork", "--root", str(root), "c", "c2"], ["rm", "--root", str(root), "c2"],
                ["import", "--root", str(root), str(tmp_path / "c.colibundle"), "--as", "c3"]):
        assert main(cmd) == 0, capsys.readouterr().err
    more = len(expected) - len(committed) - 20
    assert main(["generate", "--root", str(root), "--session", "c", "--max-new", str(more)]) == 0, \
        capsys.readouterr().err
    resumed = history(root, "c")
    assert len(resumed) > len(committed) and resumed == expected[:len(resumed)]  # token-exact
    assert history(root, "c3") == committed
    assert sorted(p.name for p in (root / "tmp").iterdir()) == []
