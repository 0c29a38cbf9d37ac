"""Markers for tests that need an optional extra: they skip, saying which, when it is absent; and
:func:`without_modules`, a subprocess's environment in which an extra's modules are absent."""
from __future__ import annotations

import os
from collections.abc import Iterable
from importlib.util import find_spec
from pathlib import Path

import pytest

CUDA_EXTRA = "the cuda extra is not installed: pip install -e '.[cuda]' (cupy-cuda12x + nvidia-cuda-nvrtc-cu12)"

needs_cuda_extra = pytest.mark.skipif(find_spec("cupy") is None or find_spec("cupy_backends") is None,
                                      reason=CUDA_EXTRA)


BLOCKER = '''import importlib.abc
import sys

BLOCKED = frozenset({blocked!r})


class _NotInstalled(importlib.abc.MetaPathFinder):
    """Makes these modules absent, as in an install without their extra."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''


def without_modules(where: Path, blocked: Iterable[str], env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a subprocess in which importing any of ``blocked`` (top-level names) raises
    ModuleNotFoundError, as in an install without the extra that brings them: a ``sitecustomize``
    written to ``where`` puts a finder first on ``sys.meta_path``. ``env``: the base (os.environ)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(set(blocked))))
    base = dict(os.environ if env is None else env)
    path = [str(where), *filter(None, base.get("PYTHONPATH", "").split(os.pathsep))]
    return {**base, "PYTHONPATH": os.pathsep.join(path)}
