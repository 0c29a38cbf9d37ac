"""Find re-exports: names an ordinary module (not a package's ``__init__``) imports from another
module of ours and hands on, either in its ``__all__`` or because some module (code, tests,
benchmarks) imports the name from it or reads it as ``module.name``; ``import *`` is reported too.

Run ``python -m tests.house.reexports`` to list them; ``tests/house/test_imports.py`` asserts
there are none (the house rule: import a name from the module that defines it)."""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE_PACKAGES = ("kernels", "sessionstore", "tools")  # modules whose re-exports count
READER_PACKAGES = (*SOURCE_PACKAGES, "tests", "bench", "training")  # modules whose imports are read


@dataclass(frozen=True)
class Reexport:
    """``name`` is bound in ``module`` by an import of ours and handed on, as ``how`` says."""

    module: str
    name: str
    how: str

    def __str__(self) -> str:
        return f"{self.module}.{self.name}: {self.how}"


def module_name(path: Path, root: Path = REPO) -> str:
    """The dotted name of the module at ``path`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = REPO, packages: tuple[str, ...] = READER_PACKAGES) -> dict[str, Path]:
    """Every module under ``packages`` of ``root``, by dotted name."""
    return {module_name(p, root): p for pkg in packages if (root / pkg).is_dir()
            for p in sorted((root / pkg).rglob("*.py"))}


def _absolute(node: ast.ImportFrom, name: str, is_pkg: bool) -> str:
    base = node.module or ""
    if node.level:
        package = name if is_pkg else name.rpartition(".")[0]
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return base


def _top_level_imports(tree: ast.Module, name: str, is_pkg: bool, ours: set[str]) -> dict[str, str]:
    """Names bound at module level by ``from <our module> import x`` (including under ``if`` and
    ``try``), mapped to the module they come from; sub-modules of ours are not names."""
    bound: dict[str, str] = {}
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.If, ast.Try)):
            stack.extend(node.body)
            stack.extend(node.orelse)
            if isinstance(node, ast.Try):
                stack.extend(node.finalbody)
                for handler in node.handlers:
                    stack.extend(handler.body)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, name, is_pkg)
            if source not in ours:
                continue
            for alias in node.names:
                if f"{source}.{alias.name}" not in ours:
                    bound[alias.asname or alias.name] = source
    return bound


def _dunder_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            value = node.value
            if isinstance(value, (ast.List, ast.Tuple)):
                return [e.value for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def find_reexports(root: Path = REPO) -> list[Reexport]:
    """Every re-export from an ordinary module of ``SOURCE_PACKAGES`` under ``root``."""
    found = modules(root)
    ours = set(found)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in found.items()}
    imported: dict[str, dict[str, str]] = {}
    out: set[Reexport] = set()
    for name, tree in trees.items():
        is_pkg = found[name].name == "__init__.py"
        imported[name] = _top_level_imports(tree, name, is_pkg, ours)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                out.add(Reexport(name, "*", f"star import of {_absolute(node, name, is_pkg)}"))
    ordinary = {n for n in found if found[n].name != "__init__.py" and n.split(".")[0] in SOURCE_PACKAGES}
    for name in ordinary:
        for exported in _dunder_all(trees[name]):
            if exported in imported[name]:
                out.add(Reexport(name, exported, f"in __all__ (defined in {imported[name][exported]})"))
    for reader, tree in trees.items():
        is_pkg = found[reader].name == "__init__.py"
        aliases: dict[str, str] = {}  # local name -> our ordinary module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(node, reader, is_pkg)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in ordinary:
                        aliases[alias.asname or alias.name] = sub
                    elif source in ordinary and alias.name in imported[source]:
                        out.add(Reexport(source, alias.name, f"imported from it by {reader}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in ordinary and alias.asname:
                        aliases[alias.asname] = alias.name
        patched = _patched_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr not in patched:
                target = _dotted(node.value)
                module = aliases.get(target, target if target in ordinary else "")
                if module and node.attr in imported[module]:
                    out.add(Reexport(module, node.attr, f"read as {target}.{node.attr} by {reader}"))
    return sorted(out, key=lambda r: (r.module, r.name, r.how))


def _patched_names(tree: ast.Module) -> set[str]:
    """Attribute names a module patches (``setattr(m, "x", ...)``, ``patch.object(m, "x")``,
    ``m.x = ...``): reading such a name from a module to patch it back is a seam, not a re-export."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _dotted(node.func).endswith(("setattr", "patch.object")):
            names.update(a.value for a in node.args[1:2] if isinstance(a, ast.Constant) and isinstance(a.value, str))
        elif isinstance(node, ast.Assign):
            names.update(t.attr for t in node.targets if isinstance(t, ast.Attribute))
    return names


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else ""
    return ""


def main(argv: list[str] | None = None) -> int:
    """Print every re-export (one a line, then a count per module); exit 1 when there is one."""
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else REPO
    found = find_reexports(root)
    for reexport in found:
        print(reexport)
    per_module: dict[str, set[str]] = {}
    for reexport in found:
        per_module.setdefault(reexport.module, set()).add(reexport.name)
    for module, names in sorted(per_module.items()):
        print(f"# {module}: {len(names)} names")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
