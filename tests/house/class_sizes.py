"""Count each class's methods, read from the source: its own (``def`` in its body, properties and
dunders included) and those of its bases defined in this project (``kernels``, ``sessionstore``,
``tools``), each name once however many classes of the chain define it.

The house rule (issue 27): a class does one job, so it has at most :data:`MAX_METHODS` methods,
unless its docstring says why in a sentence that starts ``Why N methods:`` with N its count now
(a class that grows or shrinks restates its reason). Run ``python -m tests.house.class_sizes`` to
list the classes over the limit; ``tests/house/test_class_sizes.py`` asserts each gives its reason."""
from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.house.reexports import REPO, _absolute, modules

MAX_METHODS = 20
COUNTED_PACKAGES = ("kernels", "sessionstore", "tools")
REASON = re.compile(r"\bWhy (\d+) methods:")


@dataclass(frozen=True)
class ClassSize:
    """``module.name`` has ``methods`` methods (with its project bases'); ``stated``: the N of its
    docstring's ``Why N methods:`` sentence, or None."""

    module: str
    name: str
    methods: int
    stated: int | None

    def __str__(self) -> str:
        said = "no reason given" if self.stated is None else f"its docstring says {self.stated}"
        return f"{self.module}.{self.name}: {self.methods} methods, {said}"


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

    sizes = []
    for key, node in sorted(classes.items()):
        match = REASON.search(" ".join((ast.get_docstring(node) or "").split()))
        sizes.append(ClassSize(key[0], key[1], len(methods(key)), int(match.group(1)) if match else None))
    return sizes


def unexplained(root: Path = REPO) -> list[str]:
    """The classes over :data:`MAX_METHODS` whose docstring gives no reason, or a reason for
    another count than theirs."""
    return [str(s) for s in class_sizes(root) if s.methods > MAX_METHODS and s.stated != s.methods]


def main(argv: list[str] | None = None) -> int:
    """Print every class over the limit (with whether it says why); exit 1 when one does not."""
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else REPO
    for size in class_sizes(root):
        if size.methods > MAX_METHODS:
            print(size)
    return 1 if unexplained(root) else 0


if __name__ == "__main__":
    raise SystemExit(main())
