"""Find tests that reach into production code's private names: ``from <ours> import _x``, a read
of ``module._x`` on one of our modules, or ``obj._x`` where ``_x`` is a private name that the
production packages define (a method, class or ``self._x`` attribute) and the tests do not.

A test states what the code promises through its public surface, or through a ``testing`` helper
that says why it exists (sessionstore.testing, kernels.testing, ...). Run
``python -m tests.house.private_names`` to list what is left; ``tests/house`` asserts there is none."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.house.reexports import REPO, _absolute, _dotted, modules

PRODUCTION = ("kernels", "sessionstore", "tools", "bench")

# Left, each with its reason; the list may only shrink (tests/house fails on a new one and on a
# listed one that is gone). Empty: the fault seams are passed in (a Durability, a compressor) or
# reached through the standard library the code calls; internal state is read through properties.
KNOWN_PRIVATE_USES: frozenset[str] = frozenset()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_private(trees: dict[str, ast.Module], *, any_target: bool) -> set[str]:
    """Private names the given modules define: functions, classes, methods, module-level names and
    ``self._y = ...`` attributes; with ``any_target``, every ``x._y = ...`` target too (production
    code sets its objects' fields from outside them; a test doing so patches what it does not own)."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Attribute) and _private(sub.attr) and (
                                any_target or _dotted(sub.value) == "self"):
                            names.add(sub.attr)
                        elif isinstance(sub, ast.Name) and _private(sub.id):
                            names.add(sub.id)
    return names


def find_private_uses(root: Path = REPO) -> list[str]:
    """``test module: what`` for every test access to a private name of production code (once
    per module and access, so that a list of known ones does not move with line numbers)."""
    found = modules(root, (*PRODUCTION, "tests"))
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in found.items()}
    production = {n: t for n, t in trees.items() if n.split(".")[0] in PRODUCTION}
    tests = {n: t for n, t in trees.items() if n.split(".")[0] == "tests"}
    ours_private = _defined_private(production, any_target=True) - _defined_private(tests, any_target=False)
    out: set[str] = set()
    for name, tree in sorted(tests.items()):
        is_pkg = found[name].name == "__init__.py"
        modules_bound: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(node, name, is_pkg)
                if source.split(".")[0] not in PRODUCTION:
                    continue
                for alias in node.names:
                    if _private(alias.name):
                        out.add(f"{name}: from {source} import {alias.name}")
                    if f"{source}.{alias.name}" in found:
                        modules_bound.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PRODUCTION:
                        modules_bound.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                base = _dotted(node.value)
                if base in modules_bound or base.split(".")[0] in PRODUCTION or node.attr in ours_private:
                    out.add(f"{name}: {base or '<expr>'}.{node.attr}")
            elif isinstance(node, ast.Call) and _dotted(node.func).endswith(("setattr", "getattr", "patch.object")):
                args = node.args[1:2]
                if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str) \
                        and _private(args[0].value) and args[0].value in ours_private:
                    out.add(f"{name}: {_dotted(node.func)}(..., {args[0].value!r})")
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    """Print every test access to a private name of production code; exit 1 when there is one."""
    args = sys.argv[1:] if argv is None else argv
    found = find_private_uses(Path(args[0]) if args else REPO)
    for line in found:
        print(line, "(known)" if line in KNOWN_PRIVATE_USES else "")
    print(f"# {len(found)} accesses in {len({line.split(':')[0] for line in found})} test modules")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
