"""The house's import rules, read from the source: no circle between modules, rooms import only
the rooms below them (kvfile < sessions < migration), and modules outside a room use its surface."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.house.reexports import find_reexports

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "sessionstore", "tools")
ROOMS = ("kvfile", "sessions", "migration")  # each may import only those before it


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module of ours that ``path`` imports, anywhere in it (TYPE_CHECKING and
    function-local imports included: a circle is a circle for a reader too)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(path, name, known) for name, path in modules.items()}
    for name in graph:  # a package's __init__ re-exporting its own modules is not a circle
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read() -> None:
    graph = _graph()
    assert "sessionstore.kvfile" in graph["sessionstore.sessions.session"]
    assert "sessionstore.kvfile.reader" in graph["sessionstore.kvfile.writer"]


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_rooms_import_only_the_rooms_below_them() -> None:
    bad = []
    for name, targets in _graph().items():
        parts = name.split(".")
        if parts[0] != "sessionstore" or len(parts) < 2 or parts[1] not in ROOMS:
            continue
        allowed = set(ROOMS[: ROOMS.index(parts[1]) + 1])
        for target in targets:
            tparts = target.split(".")
            if tparts[0] == "sessionstore" and len(tparts) > 1 and tparts[1] in ROOMS and tparts[1] not in allowed:
                bad.append(f"{name} imports {target}")
    assert not bad, bad


def test_the_kvfile_room_imports_nothing_above_it() -> None:
    for name, targets in _graph().items():
        if name.startswith("sessionstore.kvfile"):
            above = ("sessionstore.sessions", "sessionstore.migration", "tools")
            assert not {t for t in targets if t.startswith(above)}, name


def test_no_import_circles() -> None:
    assert _cycles(_graph()) == []


def test_the_known_circles_are_the_only_ones() -> None:
    """Until they are removed: no NEW circle appears (each listed one may only shrink)."""
    known: list[set[str]] = []
    for cycle in _cycles(_graph()):
        assert any(set(cycle) <= k for k in known), f"a new import circle: {cycle}"


def test_names_are_imported_from_the_module_that_defines_them() -> None:
    """Re-exports only in a package's ``__init__`` (``python -m tests.house.reexports`` lists them)."""
    found = find_reexports()
    assert not found, "\n".join(map(str, found))


def test_the_reexport_finder_finds_each_kind(tmp_path: Path) -> None:
    pkg = tmp_path / "sessionstore" / "room"
    pkg.mkdir(parents=True)
    (tmp_path / "sessionstore" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from sessionstore.room.home import X\n__all__ = ['X']\n")  # allowed
    (pkg / "home.py").write_text("X = 1\nY = 2\nZ = 3\nW = 4\n")
    (pkg / "hall.py").write_text("from sessionstore.room.home import W, X, Y, Z\n__all__ = ['X']\n")
    (pkg / "star.py").write_text("from sessionstore.room.home import *\n")
    (pkg / "user.py").write_text("from sessionstore.room import hall\nfrom sessionstore.room.hall import Y\n"
                                 "print(hall.Z, Y)\n")
    (pkg / "patcher.py").write_text("from sessionstore.room import hall\nreal = hall.W\nhall.W = None\n")
    found = {(r.module, r.name) for r in find_reexports(tmp_path)}
    assert found == {("sessionstore.room.hall", "X"), ("sessionstore.room.hall", "Y"),
                     ("sessionstore.room.hall", "Z"), ("sessionstore.room.star", "*")}
