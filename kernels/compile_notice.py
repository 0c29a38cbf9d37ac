"""A notice on stderr while numba compiles this package's kernels for the first time.

The kernels are compiled ahead of time with explicit signatures and cached on disk (``cache=True``),
so the compile happens when their module is first imported on a machine, about 30 s for all of them
on two cores, and never again. A module with compiled kernels calls :func:`announce_if_cold` before
its decorators run: if numba's cache holds nothing for that module yet, one line says what is
happening (once per process), so a first ``coli-kv chat`` or ``serve`` does not look hung.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

_said = False


def cached(module_file: str) -> bool:
    """True when numba's on-disk cache holds an index (``*.nbi``) for a kernel of ``module_file``:
    in the module's ``__pycache__`` (numba's default) or under ``$NUMBA_CACHE_DIR``."""
    path = Path(module_file)
    pattern = f"{path.stem}.*.nbi"
    if any((path.parent / "__pycache__").glob(pattern)):
        return True
    elsewhere = os.environ.get("NUMBA_CACHE_DIR")
    return elsewhere is not None and any(Path(elsewhere).rglob(pattern))


def announce_if_cold(module_file: str) -> None:
    """Say once on stderr that the kernels are being compiled, when ``module_file``'s are not cached."""
    global _said
    if _said or os.environ.get("NUMBA_DISABLE_JIT") == "1" or cached(module_file):
        return
    _said = True
    print("coli-kv: compiling the numba kernels (first run on this machine, about 30 s; cached after)",
          file=sys.stderr, flush=True)


__all__ = ["announce_if_cold", "cached"]
