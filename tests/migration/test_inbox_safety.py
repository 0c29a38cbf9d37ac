"""The inbox writes safely (issue 9.5): every file it writes is a new regular file made with the
safe create (O_CREAT|O_EXCL|O_NOFOLLOW); a planted symlink never redirects a write."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kernels.errors import ColiError, FormatError
from sessionstore import log as store_log
from sessionstore.migration import inbox as inbox_mod
from sessionstore.migration import migrate
from sessionstore.migration.inbox import Inbox
from sessionstore.sessions.store import SessionStore

NAME = "x.colibundle"


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Inbox, Path, Path]:
    box = tmp_path / "inbox"
    box.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    return Inbox(SessionStore(tmp_path / "store"), box), box, victim


def vanish_mid_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundle disappears while it is being imported (another process took it)."""
    def fake_import(store: SessionStore, source: object, *, source_name: str, **_: object) -> None:
        Path(source_name).unlink()
        raise ColiError(f"{source_name}: the bundle ended early")

    monkeypatch.setattr(migrate, "import_bundle", fake_import)


def test_a_vanished_bundles_reason_never_follows_a_planted_symlink(
        setup: tuple[Inbox, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    inbox, box, victim = setup
    (box / NAME).write_bytes(b"bundle bytes")
    (box / (NAME + ".reason")).symlink_to(victim)  # where the old code wrote the reason
    (inbox.failed / (NAME + ".reason")).symlink_to(victim)
    vanish_mid_import(monkeypatch)
    inbox.scan()
    [outcome] = inbox.drain()
    assert not outcome.ok and "ended early" in (outcome.reason or "")
    assert victim.read_text() == "precious\n"
    written = inbox.failed / (NAME + ".1.reason")  # a name free for the bundle and its reason
    assert written.is_file() and not written.is_symlink()
    assert "ended early" in written.read_text()
    assert (box / (NAME + ".reason")).is_symlink() and (inbox.failed / (NAME + ".reason")).is_symlink()


def test_a_symlink_planted_at_the_chosen_name_is_refused_and_logged(
        setup: tuple[Inbox, Path, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    inbox, box, victim = setup
    (box / NAME).write_bytes(b"not a bundle")
    raced = inbox.failed / NAME
    planted = Path(str(raced) + ".reason")

    real_rename = os.rename

    def rename_then_plant(src, dst, *args, **kwargs) -> None:
        real_rename(src, dst, *args, **kwargs)
        if Path(dst) == raced:  # the link lands after the name was chosen, before the reason is written
            planted.symlink_to(victim)

    monkeypatch.setattr(os, "rename", rename_then_plant)
    monkeypatch.setenv("COLI_LOG", "json")
    store_log.reconfigure()
    try:
        inbox.scan()
        [outcome] = inbox.drain()
        err = capsys.readouterr().err
    finally:
        monkeypatch.setenv("COLI_LOG", "off")
        store_log.reconfigure()
    assert not outcome.ok and outcome.reason
    assert victim.read_text() == "precious\n" and planted.is_symlink()
    assert raced.read_bytes() == b"not a bundle"
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(e["event"] == "inbox.reason_refused" and e["path"] == str(planted) for e in events)


def test_done_and_failed_must_be_real_directories(tmp_path: Path) -> None:
    box = tmp_path / "inbox"
    box.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (box / "failed").symlink_to(elsewhere)
    with pytest.raises(FormatError, match="symlink"):
        Inbox(SessionStore(tmp_path / "store"), box)


def test_a_bundle_swapped_for_a_symlink_after_its_check_is_never_read(
        setup: tuple[Inbox, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The inbox checks a landed name with lstat, then opens it: a symlink put in its place in
    between (lstat reported the regular file that was there) is refused, not followed."""
    inbox, box, victim = setup
    (box / NAME).write_bytes(b"bundle bytes")
    regular = inbox_mod.os.lstat(box / NAME)
    (box / NAME).unlink()
    (box / NAME).symlink_to(victim)
    real_lstat = inbox_mod.os.lstat
    monkeypatch.setattr(inbox_mod.os, "lstat", lambda p, *a, **k: regular if Path(p) == box / NAME
                        else real_lstat(p, *a, **k))
    read: list[object] = []
    monkeypatch.setattr(migrate, "import_bundle", lambda store, source, **_: read.append(source.read()))
    outcome = inbox.process(box / NAME)  # as the watcher hands over a name it saw land
    assert outcome is not None and not outcome.ok and "symlink" in (outcome.reason or "") and read == []
    assert victim.read_text() == "precious\n"
