"""The house's size rule, read from the source: a module of ``sessionstore/`` is at most
:data:`MAX_LINES` lines (issue 27: a reader finds a module's job in one sitting), every room
(``service/`` too, now that it is split into its rooms). A room still being split would be left
out here until then (:data:`NOT_YET_HELD`).

A module that could not be split yet is in :data:`KNOWN_LONG_MODULES`; the list may only shrink:
a long module not listed fails, and so does a listed one that is now short enough (or gone).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.house.test_imports import REPO, unexpected

MAX_LINES = 400
NOT_YET_HELD: tuple[str, ...] = ()  # every room is held now (service/ was split into its rooms)

# Modules over MAX_LINES, each with why it is not split yet.
KNOWN_LONG_MODULES: frozenset[str] = frozenset()


def long_modules(root: Path = REPO) -> dict[str, int]:
    """``sessionstore/`` modules (outside :data:`NOT_YET_HELD`) longer than MAX_LINES -> their lines."""
    out = {}
    for path in sorted((root / "sessionstore").rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name.startswith(NOT_YET_HELD):
            continue
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            out[name] = lines
    return out


def test_modules_are_at_most_400_lines() -> None:
    found = long_modules()
    assert unexpected(found, KNOWN_LONG_MODULES) == [], found


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "sessionstore", tmp_path / "sessionstore",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return tmp_path


def test_a_module_growing_past_the_limit_fails(scratch: Path) -> None:
    """The rule is not vacuous: a short module grown to MAX_LINES + 1 lines is found, one at
    exactly MAX_LINES is not, and a long one under service/ is found too (every room is held)."""
    grown = scratch / "sessionstore" / "kvfile" / "lock.py"
    text = grown.read_text()
    pad = MAX_LINES - len(text.splitlines())
    grown.write_text(text + "#\n" * pad)
    assert "sessionstore/kvfile/lock.py" not in long_modules(scratch)
    grown.write_text(text + "#\n" * (pad + 1))
    (scratch / "sessionstore" / "service" / "long.py").write_text("#\n" * (MAX_LINES + 1))
    assert unexpected(long_modules(scratch), KNOWN_LONG_MODULES) == [
        "new: sessionstore/kvfile/lock.py", "new: sessionstore/service/long.py"]


def test_a_listed_module_now_short_fails(scratch: Path) -> None:
    """A listed long module passes while it is long; once split (here: cut to one line) it must
    leave the list. The list is empty now, so a module is grown past the limit to be listed."""
    listed = "sessionstore/kvfile/lock.py"
    text = (scratch / listed).read_text()
    (scratch / listed).write_text(text + "#\n" * (MAX_LINES + 1))
    assert unexpected(long_modules(scratch), {*KNOWN_LONG_MODULES, listed}) == []
    (scratch / listed).write_text('"""Split."""\n')
    assert unexpected(long_modules(scratch), {*KNOWN_LONG_MODULES, listed}) == [
        f"gone, remove from the list: {listed}"]
