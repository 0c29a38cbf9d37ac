"""A refused `coli-kv import` removes only what it created: an existing empty directory stays empty,
an absent root stays absent, and a directory or store that held anything keeps exactly its contents."""
from __future__ import annotations

from pathlib import Path

import pytest

from sessionstore.sessions.store import SessionStore
from tests.support.migrate import make_session, tree_state
from tools.coli_kv import main


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A good bundle and three refused ones: corrupt (a flipped byte), empty, truncated."""
    base = tmp_path_factory.mktemp("bundles")
    src = SessionStore(base / "src")
    make_session(src, "chat", 25)
    good = base / "good.colibundle"
    assert main(["export", "--root", str(src.root), "chat", str(good)]) == 0
    data = good.read_bytes()
    corrupt = bytearray(data)
    corrupt[len(corrupt) // 2] ^= 0x20
    out = {"good": good, "corrupt": base / "corrupt", "empty": base / "empty", "truncated": base / "trunc"}
    out["corrupt"].write_bytes(bytes(corrupt))
    out["empty"].write_bytes(b"")
    out["truncated"].write_bytes(data[: len(data) * 2 // 3])
    return out


REFUSED = ("corrupt", "empty", "truncated")


def _refused(root: Path, bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    code = main(["import", "--root", str(root), str(bundle)])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and err.startswith("coli-kv import: error: "), err


@pytest.mark.parametrize("kind", REFUSED)
def test_an_existing_empty_directory_stays_empty(tmp_path: Path, bundles: dict[str, Path], kind: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "empty-dir"
    root.mkdir()
    _refused(root, bundles[kind], capsys)
    assert root.is_dir() and list(root.iterdir()) == []


@pytest.mark.parametrize("kind", REFUSED)
def test_an_absent_root_stays_absent(tmp_path: Path, bundles: dict[str, Path], kind: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    _refused(tmp_path / "nowhere", bundles[kind], capsys)
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("kind", REFUSED)
def test_a_directory_that_held_files_keeps_exactly_them(tmp_path: Path, bundles: dict[str, Path], kind: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """No store yet, but files of its own and a ``tmp/`` that is not ours: only our ``sessions/``
    goes (and nothing of theirs, the tmp/ included)."""
    root = tmp_path / "dir"
    (root / "tmp").mkdir(parents=True)
    (root / "notes.txt").write_bytes(b"mine")
    (root / "tmp" / "scratch").write_bytes(b"also mine")
    before = tree_state(root)
    _refused(root, bundles[kind], capsys)
    assert tree_state(root) == before


@pytest.mark.parametrize("kind", REFUSED)
@pytest.mark.parametrize("holding", [True, False], ids=["with-a-session", "empty-store"])
def test_an_existing_store_keeps_exactly_its_contents(tmp_path: Path, bundles: dict[str, Path], kind: str,
                                                      holding: bool, capsys: pytest.CaptureFixture[str]) -> None:
    store = SessionStore(tmp_path / "store")
    if holding:
        make_session(store, "keep", 3)
    before = tree_state(store.root)
    _refused(store.root, bundles[kind], capsys)
    assert tree_state(store.root) == before
    assert SessionStore(store.root, create=False).directory.ids() == (["keep"] if holding else [])


def test_the_good_bundle_still_imports_into_an_existing_empty_directory(
        tmp_path: Path, bundles: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "empty-dir"
    root.mkdir()
    _refused(root, bundles["corrupt"], capsys)
    assert main(["import", "--root", str(root), str(bundles["good"])]) == 0
    assert SessionStore(root, create=False).info("chat").tokens == 25
