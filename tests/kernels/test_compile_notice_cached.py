"""Every module that announces a cold compile gets a cache index once warm, so a warm checkout never
prints the notice (kernels.compile_notice). A module whose kernels are only ever inlined into others'
has no index of its own: had it called ``announce_if_cold``, every process would have said it was
compiling (session 29 broke twelve tests so)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kernels.compile_notice import cached
from tests.support.warm_kernels import GROUPS, REPO

_CALL = re.compile(r"^announce_if_cold\(__file__\)", re.MULTILINE)


def _announcing() -> list[Path]:
    """The project's modules that call ``announce_if_cold(__file__)`` at import."""
    found = [p for root in ("kernels", "sessionstore") for p in sorted((REPO / root).rglob("*.py"))
             if _CALL.search(p.read_text(encoding="utf-8"))]
    assert len(found) >= 10  # the scan sees the kernels' modules (a broken pattern would see none)
    return found


def test_every_announcing_module_is_cached_once_warm() -> None:
    # tests/conftest.py warmed numba's cache (tests.support.warm_kernels) before any test ran
    cold = [str(p.relative_to(REPO)) for p in _announcing() if not cached(str(p))]
    assert cold == [], f"announce_if_cold in modules that never get a numba cache index: {cold}"


def test_a_warm_checkout_imports_every_kernel_without_the_notice() -> None:
    modules = sorted({".".join(p.relative_to(REPO).with_suffix("").parts) for p in _announcing()}
                     | {m for group in GROUPS for m in group})
    done = subprocess.run([sys.executable, "-c", "import " + ", ".join(modules)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compiling" not in done.stderr, done.stderr[-2000:]
