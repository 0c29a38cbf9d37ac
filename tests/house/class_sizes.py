"""Count each class's methods, read from the source: its own (``def`` in its body, properties and
dunders included) and those of its bases defined in this project (``kernels``, ``sessionstore``,
``tools``), each name once however many classes of the chain define it.

The house rule (issues 27 and 40): a class does one job, so it has at most :data:`MAX_METHODS`
methods, unless it is on a short list of the classes over it today, each with its count, that may
only shrink: a listed class that grows fails, one that shrinks has its count lowered, and one back
within the limit leaves the list. A docstring's reason exempts nothing. Run
``python -m tests.house.class_sizes`` to list the classes over the limit;
``tests/house/test_class_sizes.py`` holds the list (:data:`OVER_THE_LIMIT` there)."""
from __future__ import annotations

import ast
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.house.reexports import REPO, _absolute, modules

MAX_METHODS = 20
COUNTED_PACKAGES = ("kernels", "sessionstore", "tools")


@dataclass(frozen=True)
class ClassSize:
    """``module.name`` has ``methods`` methods (with its project bases')."""

    module: str
    name: str
    methods: int

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def __str__(self) -> str:
        return f"{self.qualname}: {self.methods} methods"


def _base_name(node: ast.expr) -> str | None:
    """The name a base is written as (``Residency[Session]`` -> Residency, ``mod.X`` -> X)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def class_sizes(root: Path = REPO) -> list[ClassSize]:
    """Every class of :data:`COUNTED_PACKAGES`, with its method count."""
    found = modules(root, COUNTED_PACKAGES)
    classes: dict[tuple[str, str], ast.ClassDef] = {}
    imported: dict[str, dict[str, str]] = {}  # module -> name -> the module it is imported from
    for name, path in found.items():
        tree = ast.parse(path.read_text(), str(path))
        imported[name] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(node, name, path.name == "__init__.py")
                for alias in node.names:
                    imported[name][alias.asname or alias.name] = source
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes[(name, node.name)] = node

    def resolve(module: str, base: str, seen: frozenset[str] = frozenset()) -> tuple[str, str] | None:
        if (module, base) in classes:
            return module, base
        source = imported.get(module, {}).get(base)
        if source is None or source in seen:
            return None
        return resolve(source, base, seen | {module})  # through a package's __init__ re-export

    def methods(key: tuple[str, str], seen: frozenset[tuple[str, str]] = frozenset()) -> set[str]:
        node = classes[key]
        out = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for base in node.bases:
            written = _base_name(base)
            target = resolve(key[0], written) if written else None
            if target is not None and target not in seen:
                out |= methods(target, seen | {key})
        return out

    return [ClassSize(key[0], key[1], len(methods(key))) for key in sorted(classes)]


def oversized(listed: Mapping[str, int], root: Path = REPO, sizes: list[ClassSize] | None = None) -> list[str]:
    """What breaks the rule, given ``listed`` (class -> its recorded count): a class over
    :data:`MAX_METHODS` not on the list, a listed class whose count is not its recorded one (grown:
    a breach; shrunk: lower the count, the list only shrinks), and a listed class no longer over the
    limit (or gone: it leaves the list). ``sizes``: :func:`class_sizes` of ``root``, when read already."""
    by_name = {s.qualname: s for s in (class_sizes(root) if sizes is None else sizes)}
    bad = []
    for name, size in by_name.items():
        if size.methods > MAX_METHODS and name not in listed:
            bad.append(f"{size}, over {MAX_METHODS} and not on the list")
    for name, count in sorted(listed.items()):
        size = by_name.get(name)
        if size is None or size.methods <= MAX_METHODS:
            bad.append(f"{name}: {'gone' if size is None else size.methods} methods, "
                       f"within {MAX_METHODS}: remove it from the list")
        elif size.methods > count:
            bad.append(f"{size}, grown past its listed {count}")
        elif size.methods < count:
            bad.append(f"{size}, shrunk from its listed {count}: lower its count on the list")
    return bad


def main(argv: list[str] | None = None) -> int:
    """Print every class over the limit."""
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else REPO
    for size in class_sizes(root):
        if size.methods > MAX_METHODS:
            print(size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
