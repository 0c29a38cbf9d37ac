"""numba's cache of the package's kernels is dropped when any source of the package changes (an edit to
a callee that numba's own per-file stamp does not see), kept otherwise, in ``__pycache__`` or under
``$NUMBA_CACHE_DIR``; and a fresh process on a changed tree drops the real package's caches."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cache_stamp import cache_folders, refresh_stale_caches, stamp_path

REPO = Path(__file__).resolve().parents[2]


def package(tmp_path: Path) -> Path:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "caller.py").write_text("def caller(): return callee()\n")
    (pkg / "sub" / "callee.py").write_text("def callee(): return 1\n")
    return pkg


def cache_files(pkg: Path, cache_dir: str | None) -> list[Path]:
    """One index and one data file in each source folder's cache folder (as numba writes them)."""
    made = []
    for folder in cache_folders(pkg, cache_dir):
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("f-1.py311.nbi", "f-1.py311.1.nbc"):
            (folder / name).write_bytes(b"x")
            made.append(folder / name)
    return made


@pytest.mark.parametrize("elsewhere", [False, True], ids=["pycache", "NUMBA_CACHE_DIR"])
def test_caches_are_kept_while_the_sources_stay_and_dropped_when_one_changes(tmp_path: Path, elsewhere: bool) -> None:
    pkg = package(tmp_path)
    cache_dir = str(tmp_path / "numba-cache") if elsewhere else None
    files = cache_files(pkg, cache_dir)
    assert refresh_stale_caches(pkg, cache_dir)  # no stamp yet: caches of unknown provenance go
    assert not any(f.exists() for f in files) and stamp_path(pkg, cache_dir).is_file()

    files = cache_files(pkg, cache_dir)  # compiled again
    assert not refresh_stale_caches(pkg, cache_dir)  # nothing changed: kept
    assert all(f.exists() for f in files)

    callee = pkg / "sub" / "callee.py"
    callee.write_text("def callee(): return 2\n")  # only the callee's file changes
    os.utime(callee, ns=(callee.stat().st_atime_ns, callee.stat().st_mtime_ns + 1_000_000_000))
    assert refresh_stale_caches(pkg, cache_dir)
    assert not any(f.exists() for f in files)  # the caller's cache too: it holds the old callee
    assert not refresh_stale_caches(pkg, cache_dir)


def test_a_new_process_on_a_changed_tree_drops_the_kernels_caches(tmp_path: Path) -> None:
    """``import kernels`` runs the check first: a stray cache file of the real package under a private
    NUMBA_CACHE_DIR, with a stamp that does not match the tree, is gone after the import."""
    cache_dir = tmp_path / "numba-cache"
    pkg = REPO / "kernels"
    stray = cache_files(pkg, str(cache_dir))
    stamp_path(pkg, str(cache_dir)).write_text("an older tree\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(REPO)}
    env.pop("NUMBA_DISABLE_JIT", None)
    subprocess.run([sys.executable, "-c", "import kernels.errors"], check=True, cwd=REPO, env=env, timeout=60)
    assert not any(f.exists() for f in stray)
    assert stamp_path(pkg, str(cache_dir)).read_text() != "an older tree\n"
