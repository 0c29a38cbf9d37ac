"""Every ``coli-kv`` process runs numpy's BLAS on one thread unless the user chose a count
(tools/blas_threads.py): set before numpy's first import, so OpenBLAS reads it, and inherited by the
engine core's process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.blas_threads import BLAS_THREAD_VARIABLES, default_to_one_blas_thread

REPO = Path(__file__).resolve().parents[2]


def test_one_thread_when_nothing_is_set() -> None:
    env: dict[str, str] = {"PATH": "/bin", "OPENBLAS_NUM_THREADS": ""}
    assert default_to_one_blas_thread(env)
    assert env["OPENBLAS_NUM_THREADS"] == "1"


@pytest.mark.parametrize("name", BLAS_THREAD_VARIABLES)
def test_a_users_choice_is_kept(name: str) -> None:
    env = {name: "3"}
    assert not default_to_one_blas_thread(env)
    assert env == {name: "3"}


def run_cli(env_extra: dict[str, str]) -> str:
    """OPENBLAS_NUM_THREADS as a process running coli-kv's main sees it, and whether numpy came after."""
    env = {k: v for k, v in os.environ.items() if k not in BLAS_THREAD_VARIABLES} | env_extra
    code = ("import os, sys\nfrom tools.coli_kv import main\nbefore = 'numpy' in sys.modules\n"
            "try:\n    main(['inspect', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('OPENBLAS_NUM_THREADS'), before)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_the_cli_sets_it_before_numpy_is_imported() -> None:
    assert run_cli({}) == "1 False"
    assert run_cli({"OPENBLAS_NUM_THREADS": "2"}) == "2 False"
