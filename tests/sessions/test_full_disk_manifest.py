"""A whole manifest write that fails on a full disk changes nothing (FORMAT.md 5.3.1, 5.5).

The failure CI saw once: a session with one committed turn (prompt [5, 6, 7] + 1 token) was given
the same prompt again on a full disk. Prefix reuse truncates to 2 records; the truncate gave the
commit state page the new epoch, then its manifest replace found no room for the temp file
(ENOSPC). Every reader (GET history, listing, fork, export) then ignored the page (other epoch)
and read the manifest's own fields, those of the session's creation: an empty history, and a fork
or bundle with no records, until the session was reopened. A failed write now puts the page back
and leaves the session as it was, so it continues exactly.
"""
from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernels.model.sampling import Sampler
from sessionstore.sessions import manifest as manifest_mod
from sessionstore.sessions.commit_state_page import read_state_page
from sessionstore.sessions.manifest import MANIFEST_NAME, read_manifest, write_manifest
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turn_loop import reference_turns

PROMPT = [5, 6, 7]


def _no_room(monkeypatch: pytest.MonkeyPatch, *, after_rename: bool = False) -> list[str]:
    """Every replace of session s0's manifest fails as on a full disk (before its rename, the file
    untouched), or with ``after_rename`` as a failing directory fsync would (the new file in place);
    other manifests (a fork's) are written."""
    real = manifest_mod.atomic_replace
    failed: list[str] = []

    def replace(path: Any, data: bytes, **kw: Any) -> None:
        if "/sessions/s0/" not in os.fspath(path):
            return real(path, data, **kw)
        failed.append(os.fspath(path))
        if after_rename:
            real(path, data, **kw)
            raise OSError(errno.EIO, "Input/output error (injected)")
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(manifest_mod, "atomic_replace", replace)
    return failed


def test_a_truncate_that_cannot_write_its_manifest_changes_nothing_and_the_session_continues_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SessionStore(tmp_path)
    session = store.create("s0", "tiny", kv_dtype="fp8")
    session.generate(PROMPT, 1)
    first = store.history("s0")
    assert first[:3] == PROMPT and len(first) == 4
    page = read_state_page(session.directory / MANIFEST_NAME)

    failed = _no_room(monkeypatch)
    with pytest.raises(OSError, match="injected"):
        session.generate(PROMPT, 5)  # the prompt again: prefix reuse truncates to 2 records first
    assert failed, "the truncate never wrote its manifest"
    assert store.history("s0") == first  # what readers see: the committed turn, not the creation's fields
    assert read_state_page(session.directory / MANIFEST_NAME) == page
    assert session.history() == first and session.manifest.epoch == 0 and session.committed == 3
    store.fork("s0", "copy")  # a copy made now holds the committed turn
    assert store.history("copy") == first

    monkeypatch.undo()  # room again: the same request succeeds as it would have uninterrupted
    tokens = session.generate(PROMPT, 5).tokens
    assert tokens == reference_turns(session.model, "fp8", [(PROMPT, 1), (PROMPT, 5)], Sampler())[1]
    session.close()
    assert store.history("s0") == PROMPT + tokens


def test_a_failed_sampler_change_leaves_the_manifest_and_the_session_as_they_were(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SessionStore(tmp_path)
    session = store.create("s0", "tiny", kv_dtype="fp8")
    session.generate(PROMPT, 2)
    before = session.manifest.sampler
    _no_room(monkeypatch)
    with pytest.raises(OSError, match="injected"):
        session.generate(None, 2, sampler=Sampler(0.8, 0, 1.0, 3))
    assert session.manifest.sampler == before == read_manifest(session.directory / MANIFEST_NAME).sampler
    session.close()


def test_the_page_keeps_the_new_fields_when_the_manifest_was_renamed_before_the_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SessionStore(tmp_path)
    session = store.create("s0", "tiny", kv_dtype="fp8")
    session.generate(PROMPT, 1)
    path = session.directory / MANIFEST_NAME
    _no_room(monkeypatch, after_rename=True)  # e.g. the directory fsync failed: the new manifest is in place
    with pytest.raises(OSError, match="injected"):
        session.truncate(1)
    monkeypatch.undo()
    on_disk = read_manifest(path)  # page and manifest agree: the new epoch, its 1 record
    assert (on_disk.epoch, on_disk.committed, on_disk.pending) == (1, 1, [])
    session.abandon()


def test_a_page_shorter_than_a_page_is_put_back_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SessionStore(tmp_path)
    session = store.create("s0", "tiny", kv_dtype="fp8")
    session.generate(PROMPT, 1)
    session.close()
    path = store.session_dir("s0") / MANIFEST_NAME
    state = Path(str(path) + ".state")
    state.write_bytes(state.read_bytes()[:100])  # torn (e.g. a power cut): ignored by readers
    before = read_manifest(path)
    _no_room(monkeypatch)
    with pytest.raises(OSError, match="injected"):
        write_manifest(path, read_manifest(path))
    assert len(state.read_bytes()) == 100 and read_manifest(path) == before


# ---- the same on a real full disk (a tmpfs; mounting needs root, CI runs as root) -------------------
@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip() or done.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_a_truncate_on_a_full_tmpfs_keeps_the_committed_turn_visible(small_tmpfs: Path) -> None:
    store = SessionStore(small_tmpfs / "root")
    session = store.create("s0", "tiny", kv_dtype="fp8")
    session.generate(PROMPT, 1)
    first = store.history("s0")
    st = os.statvfs(small_tmpfs)
    filler = small_tmpfs / "filler"
    filler.write_bytes(bytes(st.f_bavail * st.f_frsize))
    with pytest.raises(OSError) as failed:
        session.generate(PROMPT, 5)
    assert failed.value.errno == errno.ENOSPC
    assert store.history("s0") == first == session.history()
    filler.unlink()
    tokens = session.generate(PROMPT, 5).tokens
    assert tokens == reference_turns(session.model, "fp8", [(PROMPT, 1), (PROMPT, 5)], Sampler())[1]
    session.close()
