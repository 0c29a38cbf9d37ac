"""The first-run notice: on a fresh copy of the kernels (numba's cache empty) importing the compiled
ones says once on stderr that numba is compiling; the next import (cache warm) says nothing. (The
package's surface compiles nothing: its compiled members are imported on first use.)"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _import_fresh_copy(where: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "NUMBA_DISABLE_JIT")}
    env["PYTHONPATH"] = str(where)
    code = ("import sys, kernels, kernels.fp8.row_quantizer\n"  # a module of compiled kernels (the smallest)
            "assert kernels.__file__.startswith(sys.argv[1]), kernels.__file__")
    done = subprocess.run([sys.executable, "-c", code, str(where)], env=env, cwd=where, capture_output=True,
                          text=True, timeout=900, check=True)
    return done.stderr


def test_a_cold_cache_says_so_once_and_a_warm_one_says_nothing(tmp_path: Path) -> None:
    shutil.copytree(REPO / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    first = _import_fresh_copy(tmp_path)
    assert first.count("coli-kv: compiling the numba kernels") == 1, first
    assert list((tmp_path / "kernels").rglob("__pycache__/*.nbi")), "numba cached its kernels in the copy"
    second = _import_fresh_copy(tmp_path)
    assert "compiling" not in second, second
