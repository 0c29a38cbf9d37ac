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
# listed one that is gone).
KNOWN_PRIVATE_USES: frozenset[str] = frozenset({
    # fault and spy seams: a test replaces a private step to make it fail or count it (a failing
    # fsync, a clone refused, a name collision planted, a compressor counted); each wants a seam
    # passed in (a Durability, an opener) instead, which changes constructors: left for that work
    "tests.kernels.test_attention_backend: monkeypatch.setattr(..., '_runner')",
    "tests.kvfile.test_crash_states: self._fd",  # a KVWriter subclass that commits in the wrong order
    "tests.kvfile.test_crash_states: self._io",
    "tests.kvfile.test_writer_stateful: self.writer._io",  # a crash injected into a live writer
    "tests.migration.test_bundle_codec: monkeypatch.setattr(..., '_cctx')",
    "tests.migration.test_bundle_codec: policy._cctx",
    "tests.migration.test_bundle_io: bundle_io._IO",
    "tests.migration.test_bundle_io: migrate._receive",
    "tests.migration.test_inbox_safety: monkeypatch.setattr(..., '_unique')",
    "tests.sessions.test_session_manifest: fp._fingerprint_files",
    "tests.sessions.test_session_manifest: monkeypatch.setattr(..., '_fingerprint_files')",
    "tests.sessions.test_store: monkeypatch.setattr(..., '_clone')",
    # state a test reads to see an internal decision (the measured sink, the lease renewals, the
    # cache's owned arrays): each wants a read-only property that says what it promises
    "tests.kernels.model.test_decoder_cache: cache._own",
    "tests.migration.test_bundle_codec: policy._measured",
    "tests.migration.test_remote: live._guard",
    "tests.migration.test_remote_faults: live._guard",
})


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
