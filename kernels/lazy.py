"""A package surface whose heavy members are imported on first use (PEP 562).

A surface that imports its compiled members eagerly makes every importer pay for numba and the
kernels' cache, however little it uses (``import kernels.errors`` runs ``kernels/__init__``).
:func:`lazy_members` gives such a surface the module ``__getattr__`` that imports a name from
the module that defines it the first time it is asked for, and keeps it in the surface's namespace.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_members(module: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of module ``module``: name -> ``homes[name]``'s attribute of that name,
    imported on first use; an AttributeError for any other name."""

    def load(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[module], name, value)
        return value

    return load


__all__ = ["lazy_members"]
