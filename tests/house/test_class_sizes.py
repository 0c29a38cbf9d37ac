"""The house's class-size rule, read from the source: a class of ``kernels/``, ``sessionstore/`` or
``tools/`` has at most :data:`MAX_METHODS` methods (its own and its project bases'), or its
docstring says why in a sentence starting ``Why N methods:`` with N its count now
(:mod:`tests.house.class_sizes`)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.house.class_sizes import MAX_METHODS, class_sizes, unexplained
from tests.house.reexports import REPO


def test_every_class_over_the_limit_says_why() -> None:
    assert unexplained() == []


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A copy of the counted packages, to grow a class in."""
    for pkg in ("kernels", "sessionstore", "tools"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("*.pyc"))
    return tmp_path


def _methods(n: int, prefix: str = "m") -> str:
    return "".join(f"    def {prefix}{i}(self) -> None:\n        pass\n\n" for i in range(n))


def test_a_class_over_the_limit_without_a_reason_fails(scratch: Path) -> None:
    """The rule is not vacuous: a scratch class of MAX_METHODS methods passes, one more fails, and
    so does one that states a stale count; the right count passes again."""
    module = scratch / "sessionstore" / "kvfile" / "scratch_class.py"
    module.write_text(f'class Scratch:\n    """A scratch class."""\n\n{_methods(MAX_METHODS)}')
    assert unexplained(scratch) == []
    module.write_text(f'class Scratch:\n    """A scratch class."""\n\n{_methods(MAX_METHODS + 1)}')
    assert unexplained(scratch) == [
        f"sessionstore.kvfile.scratch_class.Scratch: {MAX_METHODS + 1} methods, no reason given"]
    stale = f'class Scratch:\n    """A scratch class. Why {MAX_METHODS + 5} methods: it was once larger."""\n\n'
    module.write_text(stale + _methods(MAX_METHODS + 1))
    assert unexplained(scratch) == [f"sessionstore.kvfile.scratch_class.Scratch: {MAX_METHODS + 1} methods, "
                                    f"its docstring says {MAX_METHODS + 5}"]
    right = f'class Scratch:\n    """A scratch class. Why {MAX_METHODS + 1}\n    methods: one table."""\n\n'
    module.write_text(right + _methods(MAX_METHODS + 1))
    assert unexplained(scratch) == []


def test_a_project_base_counts_once_per_name(scratch: Path) -> None:
    """Methods of a project base count; a name the
    subclass overrides counts once; a base outside the project does not count."""
    (scratch / "sessionstore" / "kvfile" / "scratch_base.py").write_text(
        f"class Base:\n{_methods(12, 'b')}")
    (scratch / "sessionstore" / "sessions" / "scratch_sub.py").write_text(
        "import threading\n\nfrom sessionstore.kvfile.scratch_base import Base\n\n\n"
        f"class Sub(Base, threading.Thread):\n{_methods(9, 'b')}{_methods(9, 's')}")
    sizes = {(s.module, s.name): s.methods for s in class_sizes(scratch)}
    assert sizes[("sessionstore.kvfile.scratch_base", "Base")] == 12
    assert sizes[("sessionstore.sessions.scratch_sub", "Sub")] == 21
    assert unexplained(scratch) == ["sessionstore.sessions.scratch_sub.Sub: 21 methods, no reason given"]
