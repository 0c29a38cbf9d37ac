"""The house's import rules, read from the source. Each rule is a function of a source tree, so
each test also breaks its rule in a scratch copy of the sources and sees it fail:

- no circle between modules (the benches' among them: :data:`CIRCLE_FREE`);
- the rooms of sessionstore (kvfile < sessions < migration < service) import only the rooms below
  them, and the kvfile room imports nothing of the rooms above it or of tools;
- every module of the service is in one of its rooms (:data:`SERVICE_LEVELS`: the floor, the flat
  modules :data:`SERVICE_FLOOR` names, < steps/ < fleet/ < wire/ < engine/ < http/), and each room imports
  only its own level and those below, but those :data:`APART` (http, the API process, imports nothing
  of engine, the core: both speak the wire room's types);
- outside a room (a room of sessionstore or of the service), import its surface (its package
  ``__init__``), except a module the surface leaves out because it needs an optional extra
  (:data:`BEHIND_AN_EXTRA`); the room surfaces import none (but those of :data:`EXTRA_ROOMS`:
  ``http``, the API process, ``engine``, the core's, and ``wire``, both's), and each names its public names in
  ``__all__``; a module run with ``python -m`` (the core's process) is left out of its surface;
- the engine loop's room (``steps``, which ``chat`` and ``generate`` run in process) and the CLI
  modules that use it import none of the service's web and IPC extras;
- every name imported from the module that defines it (:mod:`tests.house.reexports`);
- tests use production code's public surface, not its private names (:mod:`tests.house.private_names`).
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.house.private_names import KNOWN_PRIVATE_USES, find_private_uses
from tests.house.reexports import find_reexports

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "sessionstore", "tools")
CIRCLE_FREE = (*PACKAGES, "bench")  # the circle rule also holds the benches (issue 40 part 4)
ROOMS = ("kvfile", "sessions", "migration", "service")  # each may import only those before it

# Modules a room's surface leaves out because importing them imports an optional extra; code outside
# the room imports them by their own name, where it needs them (the CLI's serve and chat commands).
BEHIND_AN_EXTRA = {
    "sessionstore.sessions.conversation_chat": "text",  # jinja2, for the chat template
    "sessionstore.service.http": "service",  # starlette, uvicorn, pydantic, prometheus_client: the API process
    "sessionstore.service.fleet.bundle_pull": "service",  # httpx, msgspec
    "sessionstore.service.fleet.bundle_upload": "service",  # msgspec
    "sessionstore.service.fleet.proxy": "service",  # starlette, httpx
}
# `coli-kv chat` and `generate` run their turns on the engine loop in process (issue 23 part 3):
# these modules, the loop's room among them, import none of the service's web and IPC extras.
IN_PROCESS_CORE = ("tools.cmd_chat", "tools.cmd_generate", "tools.cmd_sessions", "tools._core",
                   "sessionstore.service.steps")
SERVICE_EXTRAS = ("starlette", "uvicorn", "pydantic", "prometheus_client", "httpx", "zmq", "msgspec")
# The service's rooms, lowest first: each imports only its own level and those below. The floor is
# the flat modules of service/ (its package surface among them); fleet/, engine/ and http/ are packages.
SERVICE_LEVELS = ("floor", "steps", "fleet", "wire", "engine", "http")
SERVICE_FLOOR = frozenset({"sessionstore.service", "sessionstore.service.bind", "sessionstore.service.errors",
                           "sessionstore.service.limits"})
SERVICE_ROOMS = ("steps", "fleet", "wire", "engine", "http")  # the service's rooms that are (or will be) packages
# Rooms whose surface is an extra's by design: the API process, the engine core (greenlet, pyzmq, msgspec), and
# what the two speak (msgspec).
EXTRA_ROOMS = {"sessionstore.service.http": "service", "sessionstore.service.engine": "service",
               "sessionstore.service.wire": "service"}
# Rooms that may not import each other though one sits above the other: the API process (http) loads no
# engine core (Engine, TierManager, greenlet); what the two exchange is the wire room's (issue 40 part 2).
APART = {"http": "engine"}
# What the API process (serve's parent) imports: none of the core's modules, nor the engine loop's.
API_PROCESS = ("sessionstore.service.http", "tools.cmd_serve")

EXTRAS = ("jinja2", "tokenizers", "starlette", "uvicorn", "pydantic", "prometheus_client", "httpx", "torch")


# --- reading the source --------------------------------------------------------------------------
def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    return {_module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


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


def graph(root: Path = REPO, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, for ``packages`` under ``root``."""
    modules = _modules(root, packages)
    known = set(modules)
    out = {name: _imports(path, name, known) for name, path in modules.items()}
    for name in out:  # a package's __init__ re-exporting its own modules is not a circle
        out[name] = {t for t in out[name] if not name.startswith(t + ".")}
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
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
        for w in sorted(edges.get(v, ())):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "sessionstore" and len(parts) > 1 and parts[1] in ROOMS else None


def downward_breaches(edges: dict[str, set[str]]) -> list[str]:
    """``a imports b`` where a's room sits below b's."""
    bad = []
    for name, targets in edges.items():
        room = _room(name)
        if room is None:
            continue
        allowed = set(ROOMS[: ROOMS.index(room) + 1])
        bad += [f"{name} imports {t}" for t in sorted(targets) if _room(t) not in (None, *allowed)]
    return bad


def kvfile_breaches(edges: dict[str, set[str]]) -> list[str]:
    """``a imports b`` where a is in the kvfile room and b in a room above it, or in tools."""
    above = tuple(f"sessionstore.{room}" for room in ROOMS[1:]) + ("tools",)
    return [f"{name} imports {t}" for name, targets in edges.items() if _room(name) == "kvfile"
            for t in sorted(targets) if t == "tools" or t.startswith(above)]


def service_level(module: str) -> str | None:
    """The service room ``module`` belongs to (one of :data:`SERVICE_LEVELS`), ``"unplaced"`` for a
    module of the service in none of them; None outside the service."""
    parts = module.split(".")
    if parts[:2] != ["sessionstore", "service"]:
        return None
    if module in SERVICE_FLOOR:
        return "floor"
    return parts[2] if len(parts) > 2 and parts[2] in SERVICE_ROOMS else "unplaced"


def unplaced_service_modules(edges: dict[str, set[str]]) -> list[str]:
    """The service's modules in none of its rooms: a flat module the floor does not name, or one in a
    package that is no room."""
    return sorted(name for name in edges if service_level(name) == "unplaced")


def service_downward_breaches(edges: dict[str, set[str]]) -> list[str]:
    """``a imports b``, both in the service, where a's room sits below b's."""
    bad = []
    for name, targets in edges.items():
        level = service_level(name)
        if level not in SERVICE_LEVELS:  # outside the service, or unplaced (a rule of its own)
            continue
        allowed = SERVICE_LEVELS[: SERVICE_LEVELS.index(level) + 1]
        bad += [f"{name} imports {t}" for t in sorted(targets) if service_level(t) not in (None, *allowed)]
    return bad


def apart_breaches(edges: dict[str, set[str]]) -> list[str]:
    """``a imports b``, a in a room of :data:`APART`'s keys and b in the room it names."""
    return [f"{name} imports {t}" for name, targets in edges.items() if service_level(name) in APART
            for t in sorted(targets) if service_level(t) == APART[service_level(name)]]


def room_packages(module: str) -> list[str]:
    """The room packages holding ``module`` (itself included when it is one), outermost first:
    ``sessionstore.service.fleet.home`` is in ``sessionstore.service`` and ``sessionstore.service.fleet``."""
    room = _room(module)
    if room is None:
        return []
    out = [f"sessionstore.{room}"]
    parts = module.split(".")
    if room == "service" and len(parts) > 2 and parts[2] in SERVICE_ROOMS:
        out.append(f"sessionstore.service.{parts[2]}")
    return out


def surface_breaches(edges: dict[str, set[str]]) -> set[str]:
    """``a imports b`` where b is a module inside a room (not a room's package) and a is outside
    that room: outside a room, only its surface is imported."""
    bad = set()
    for name, targets in edges.items():
        holding_name = room_packages(name)
        for target in targets:
            if target in BEHIND_AN_EXTRA or target in room_packages(target)[-1:]:
                continue
            if any(room not in holding_name for room in room_packages(target)):
                bad.add(f"{name} imports {target}")
    return bad


def surface_imports_its_main(edges: dict[str, set[str]], main: str) -> bool:
    """Whether the package holding ``main`` (a module run with ``python -m``) imports it: ``runpy``
    would then run a second copy of a module already imported."""
    return main in edges[main.rpartition(".")[0]]


def unexpected(found: Iterable[str], known: Iterable[str]) -> list[str]:
    """What fails a rule with known exceptions: each new breach, and each known one now gone
    (the list may only shrink, and it must say what is true)."""
    found, known = set(found), set(known)
    return [f"new: {b}" for b in sorted(found - known)] + [f"gone, remove from the list: {b}"
                                                          for b in sorted(known - found)]


# --- a scratch copy to break ---------------------------------------------------------------------
@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """The Python sources of the packages (and tests), copied to break a rule in. numba's cache
    files in ``__pycache__`` come along (copytree keeps each source's mtime, which keys that cache),
    so importing the copy loads the compiled kernels instead of compiling them for half a minute."""
    for pkg in (*PACKAGES, "tests", "bench"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("*.pyc"))
    return tmp_path


def _append(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.write_text(path.read_text() + text)


# --- the rules -----------------------------------------------------------------------------------
def test_the_graph_is_read() -> None:
    edges = graph()
    assert "sessionstore.kvfile" in edges["sessionstore.sessions.session"]
    assert "sessionstore.kvfile.reader" in edges["sessionstore.kvfile.writer"]
    assert "sessionstore.sessions" in edges["sessionstore.service.engine.engine"]


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    edges = graph(packages=CIRCLE_FREE)
    assert "bench.object_read" in edges["bench.scale"]  # the benches are read too
    assert cycles(edges) == []


def test_a_new_circle_fails_the_rule(scratch: Path) -> None:
    """The circle rule is not vacuous: a function-local import that closes a circle (header is
    imported by writer) is found in the real sources."""
    _append(scratch, "sessionstore/kvfile/header.py",
            "\n\ndef _late() -> None:\n    from sessionstore.kvfile.writer import KVWriter  # noqa: F401\n")
    found = cycles(graph(scratch))
    assert any({"sessionstore.kvfile.header", "sessionstore.kvfile.writer"} <= set(c) for c in found), found


def test_a_circle_between_benches_fails_the_rule(scratch: Path) -> None:
    """bench.scale and bench.ship_measure imported each other (issue 40): such a circle is found."""
    _append(scratch, "bench/ship_measure.py",
            "\n\ndef _late() -> None:\n    from bench.scale import measure_restore  # noqa: F401\n")
    assert cycles(graph(scratch, CIRCLE_FREE)) == [["bench.scale", "bench.ship_measure"]]


def test_rooms_import_only_the_rooms_below_them() -> None:
    assert downward_breaches(graph()) == []


def test_a_room_importing_a_room_above_fails(scratch: Path) -> None:
    _append(scratch, "sessionstore/migration/inbox.py", "\nfrom sessionstore.service import ApiError  # noqa\n")
    _append(scratch, "sessionstore/kvfile/lock.py", "\nfrom sessionstore.sessions import Session  # noqa\n")
    assert downward_breaches(graph(scratch)) == [
        "sessionstore.kvfile.lock imports sessionstore.sessions",
        "sessionstore.migration.inbox imports sessionstore.service",
    ]


def test_the_kvfile_room_imports_nothing_above_it() -> None:
    assert kvfile_breaches(graph()) == []


def test_the_kvfile_room_importing_tools_fails(scratch: Path) -> None:
    _append(scratch, "sessionstore/kvfile/verify.py", "\n\ndef _cli() -> None:\n    import tools._common  # noqa\n")
    assert kvfile_breaches(graph(scratch)) == ["sessionstore.kvfile.verify imports tools._common"]
    assert downward_breaches(graph(scratch)) == []  # a rule of its own: tools is no room


def test_outside_a_room_import_its_surface() -> None:
    assert sorted(surface_breaches(graph())) == []


def test_reaching_into_a_room_fails(scratch: Path) -> None:
    _append(scratch, "tools/cmd_verify.py", "\nfrom sessionstore.kvfile.sidecar_check import check_records  # noqa\n")
    _append(scratch, "sessionstore/service/engine/metrics.py", "\nfrom sessionstore.sessions import paths  # noqa\n")
    assert sorted(surface_breaches(graph(scratch))) == [
        "sessionstore.service.engine.metrics imports sessionstore.sessions.paths",
        "tools.cmd_verify imports sessionstore.kvfile.sidecar_check"]


def test_reaching_into_the_engine_loops_room_fails(scratch: Path) -> None:
    """The CLI's in-process core takes the loop from its room's surface, as the engine does."""
    _append(scratch, "tools/cmd_verify.py", "\nfrom sessionstore.service.steps.loop import EngineLoop  # noqa\n")
    assert sorted(surface_breaches(graph(scratch))) == ["tools.cmd_verify imports sessionstore.service.steps.loop"]


def test_the_in_process_core_imports_no_service_extra() -> None:
    """``coli-kv chat`` and ``generate`` run the engine loop without the API process's stack."""
    modules = list(IN_PROCESS_CORE)
    code = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
            f"print(sorted({{n.split('.')[0] for n in sys.modules}} & set({list(SERVICE_EXTRAS)!r})))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_service_rooms_import_only_downward() -> None:
    assert service_downward_breaches(graph()) == []


def test_a_service_room_importing_upward_fails(scratch: Path) -> None:
    """The floor may not import the fleet, the fleet not the engine core, the core not http."""
    service = "sessionstore/service"
    _append(scratch, f"{service}/errors.py", "\nfrom sessionstore.service.fleet import FleetHome  # noqa\n")
    _append(scratch, f"{service}/fleet/home.py", "\nfrom sessionstore.service.engine import TierManager  # noqa\n")
    _append(scratch, f"{service}/engine/tiers.py", "\nfrom sessionstore.service.http import ServeConfig  # noqa\n")
    assert sorted(service_downward_breaches(graph(scratch))) == [
        "sessionstore.service.engine.tiers imports sessionstore.service.http",
        "sessionstore.service.errors imports sessionstore.service.fleet",
        "sessionstore.service.fleet.home imports sessionstore.service.engine",
    ]


def test_the_api_process_imports_nothing_of_the_engine_core() -> None:
    assert apart_breaches(graph()) == []


def test_the_api_process_importing_the_engine_core_fails(scratch: Path) -> None:
    """The rule is not vacuous: http reaching the core's surface, or one of its modules in a
    function, is found (the second is also a surface breach, a rule of its own)."""
    _append(scratch, "sessionstore/service/http/app.py", "\nfrom sessionstore.service.engine import Engine  # noqa\n")
    _append(scratch, "sessionstore/service/http/session_key.py",
            "\n\ndef _late() -> None:\n    from sessionstore.service.engine.tiers import Sweeper  # noqa: F401\n")
    assert sorted(apart_breaches(graph(scratch))) == [
        "sessionstore.service.http.app imports sessionstore.service.engine",
        "sessionstore.service.http.session_key imports sessionstore.service.engine.tiers"]
    assert service_downward_breaches(graph(scratch)) == []  # http sits above engine: only APART holds it


def _loaded(root: Path, modules: Iterable[str], prefixes: Iterable[str]) -> list[str]:
    """The modules whose name starts with one of ``prefixes`` that importing ``modules`` (in a fresh
    interpreter, on the sources under ``root``) loads."""
    code = (f"import sys\nfor m in {list(modules)!r}:\n    __import__(m)\n"
            f"print(sorted(n for n in sys.modules if n.startswith({tuple(prefixes)!r})))")
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return ast.literal_eval(done.stdout.strip())


def test_the_api_process_loads_no_engine_core() -> None:
    """What ``coli-kv serve --http``'s API process imports: not the core's room (Engine, TierManager)
    nor the engine loop's (its greenlets: the greenlet package is not loaded at all, nor structlog,
    which would load it, until a log line passes its level); the wire room, which it speaks, it does."""
    loaded = _loaded(REPO, API_PROCESS, ("sessionstore.service", "greenlet", "structlog"))
    assert "sessionstore.service.wire.ipc" in loaded, loaded  # the check sees what is imported
    assert [m for m in loaded if m.startswith(("sessionstore.service.engine", "sessionstore.service.steps",
                                               "greenlet", "structlog"))] == []


def test_the_service_levels_are_read() -> None:
    assert [service_level(m) for m in ("sessionstore.service", "sessionstore.service.errors",
                                       "sessionstore.service.fleet.home", "sessionstore.service.engine",
                                       "sessionstore.service.steps.loop", "sessionstore.service.http.app",
                                       "sessionstore.service.stray", "sessionstore.sessions.store",
                                       "sessionstore.service.wire.ipc")] == [
        "floor", "floor", "fleet", "engine", "steps", "http", "unplaced", None, "wire"]


def test_every_service_module_is_in_a_room() -> None:
    assert unplaced_service_modules(graph()) == []


def test_a_service_module_outside_the_rooms_fails(scratch: Path) -> None:
    """A new flat module the floor does not name, or a package that is no room, is in no room (and so
    under no rule of the service's rooms) until it is placed."""
    service = scratch / "sessionstore" / "service"
    (service / "stray.py").write_text('"""A module left flat in service/."""\n')
    (service / "queueing").mkdir()
    (service / "queueing" / "__init__.py").write_text('"""A package that is no room."""\n')
    (service / "queueing" / "worker.py").write_text("from sessionstore.service.http import ServeConfig  # noqa\n")
    assert unplaced_service_modules(graph(scratch)) == ["sessionstore.service.queueing",
                                                        "sessionstore.service.queueing.worker",
                                                        "sessionstore.service.stray"]


def test_reaching_into_a_service_room_fails(scratch: Path) -> None:
    """Outside fleet/, engine/ or http/ (in another room of the service too), a module imports the
    room's surface: http imports ``sessionstore.service.engine``, not the engine's modules."""
    reach = "\nfrom sessionstore.service.fleet.home import FleetHome  # noqa\n"
    _append(scratch, "sessionstore/service/engine/tiers.py", reach)
    _append(scratch, "sessionstore/service/fleet/proxy.py", reach)
    _append(scratch, "sessionstore/service/http/server.py",
            "\nfrom sessionstore.service.engine.tiers import Sweeper  # noqa\n")
    _append(scratch, "sessionstore/service/engine/turns.py",
            "\nfrom sessionstore.service.engine.tiers import Sweeper  # noqa\n")
    _append(scratch, "tools/cmd_serve.py", "\nfrom sessionstore.service.http.server import serve_http  # noqa\n")
    assert sorted(surface_breaches(graph(scratch))) == [
        "sessionstore.service.engine.tiers imports sessionstore.service.fleet.home",
        "sessionstore.service.http.server imports sessionstore.service.engine.tiers",
        "tools.cmd_serve imports sessionstore.service.http.server"]  # proxy is inside fleet, turns inside engine


def _core_main() -> str:
    """The engine core's process module, as the API process runs it (``python -m``)."""
    from sessionstore.service.http.core_client import CORE_MODULE  # the service extra: the test env has it
    return CORE_MODULE


def test_a_module_run_as_main_is_not_on_its_surface() -> None:
    assert not surface_imports_its_main(graph(), _core_main())


def test_a_surface_importing_its_main_fails(scratch: Path) -> None:
    _append(scratch, "sessionstore/service/engine/__init__.py",
            "\nfrom sessionstore.service.engine.process import main  # noqa\n")
    assert surface_imports_its_main(graph(scratch), _core_main())


def _room_surfaces(root: Path) -> list[Path]:
    top = [root / "sessionstore" / room / "__init__.py" for room in ROOMS]
    inner = [root / "sessionstore" / "service" / room / "__init__.py" for room in SERVICE_ROOMS]
    return [p for p in (*top, *inner) if p.exists()]


def surface_problems(root: Path = REPO) -> list[str]:
    """A room's ``__init__`` without ``__all__``, or naming a private name or one it does not bind."""
    bad = []
    for path in _room_surfaces(root):
        tree = ast.parse(path.read_text())
        bound = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                 for alias in node.names}
        listed: list[str] | None = None
        for node in tree.body:
            names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            if isinstance(node, ast.Assign) and "__all__" in names:
                listed = list(ast.literal_eval(node.value))
        where = _module_name(path, root)
        if listed is None:
            bad.append(f"{where}: no __all__")
            continue
        bad += [f"{where}: {n} is private" for n in listed if n.startswith("_")]
        bad += [f"{where}: {n} is not imported there" for n in listed if n not in bound]
    return bad


def test_each_room_surface_names_its_public_names() -> None:
    assert surface_problems() == []


def test_a_surface_without_all_or_with_a_private_name_fails(scratch: Path) -> None:
    path = scratch / "sessionstore" / "service" / "fleet" / "__init__.py"
    path.write_text(path.read_text().replace('__all__ = ["FleetHome"', '__all__ = ["_hidden", "FleetHome"'))
    (scratch / "sessionstore" / "service" / "http" / "__init__.py").write_text('"""No list."""\n')
    path = scratch / "sessionstore" / "service" / "engine" / "__init__.py"
    path.write_text(path.read_text().replace('__all__ = ["Engine"', '__all__ = ["main", "Engine"'))
    assert surface_problems(scratch) == ["sessionstore.service.fleet: _hidden is private",
                                         "sessionstore.service.fleet: _hidden is not imported there",
                                         "sessionstore.service.engine: main is not imported there",
                                         "sessionstore.service.http: no __all__"]


def test_a_known_breach_may_only_go() -> None:
    assert unexpected({"a imports b"}, {"a imports b"}) == []
    assert unexpected({"a imports b", "c imports d"}, {"a imports b"}) == ["new: c imports d"]
    assert unexpected(set(), {"a imports b"}) == ["gone, remove from the list: a imports b"]


def _extras_imported(root: Path, modules: list[str]) -> str:
    code = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
            f"print(sorted({{n.split('.')[0] for n in sys.modules}} & set({list(EXTRAS)!r})))")
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout.strip()


def test_the_room_surfaces_import_no_optional_extra() -> None:
    """Why BEHIND_AN_EXTRA exists: a room's surface imports with the base install only."""
    rooms = ["sessionstore", *(f"sessionstore.{room}" for room in ROOMS), "sessionstore.testing",
             *(f"sessionstore.service.{room}" for room in SERVICE_ROOMS
               if (REPO / "sessionstore" / "service" / room / "__init__.py").exists()
               and f"sessionstore.service.{room}" not in EXTRA_ROOMS)]
    assert "sessionstore.service.fleet" in rooms
    assert _extras_imported(REPO, rooms) == "[]"


def test_a_surface_that_imports_an_extra_fails(scratch: Path) -> None:
    _append(scratch, "sessionstore/sessions/__init__.py",
            "\nfrom sessionstore.sessions.conversation_chat import Conversation  # noqa\n")
    _append(scratch, "sessionstore/service/fleet/__init__.py",
            "\nfrom sessionstore.service.fleet.proxy import FleetProxy  # noqa\n")
    assert _extras_imported(scratch, ["sessionstore.sessions"]) != "[]"
    assert "'starlette'" in _extras_imported(scratch, ["sessionstore.service.fleet"])


def test_names_are_imported_from_the_module_that_defines_them() -> None:
    """Re-exports only in a package's ``__init__`` (``python -m tests.house.reexports`` lists them)."""
    found = find_reexports()
    assert not found, "\n".join(map(str, found))


def test_a_reexport_fails_the_rule(scratch: Path) -> None:
    _append(scratch, "sessionstore/kvfile/layout.py", "\nfrom sessionstore.kvfile.header import HEADER_SIZE  # noqa\n")
    _append(scratch, "tools/cmd_inspect.py", "\nfrom sessionstore.kvfile.layout import HEADER_SIZE  # noqa\n")
    assert [str(r) for r in find_reexports(scratch)] == [
        "sessionstore.kvfile.layout.HEADER_SIZE: imported from it by tools.cmd_inspect"]


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


def test_tests_use_the_public_surface() -> None:
    """No test reaches a private name of production code (``python -m tests.house.private_names``)."""
    assert unexpected(find_private_uses(), KNOWN_PRIVATE_USES) == []


def test_a_test_reaching_a_private_name_fails(scratch: Path) -> None:
    (scratch / "tests" / "kvfile" / "test_scratch.py").write_text(
        "from sessionstore.kvfile import writer\nfrom sessionstore.kvfile.sweep import _boot_id\n\n\n"
        "def test_x(w) -> None:\n    assert writer._open_locked and w._fd and _boot_id()\n")
    found = unexpected(find_private_uses(scratch), KNOWN_PRIVATE_USES)
    assert found == ["new: tests.kvfile.test_scratch: from sessionstore.kvfile.sweep import _boot_id",
                     "new: tests.kvfile.test_scratch: w._fd",
                     "new: tests.kvfile.test_scratch: writer._open_locked"]
