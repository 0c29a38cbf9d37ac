"""Names for numba's compiled code in a sampling profiler: ``perf`` reads ``/tmp/perf-<pid>.map`` (one
``START SIZE NAME`` line a function, hexadecimal) for code it finds in anonymous memory, which is where
numba's code lives. Used by :mod:`bench.step_profile`; any other script may call :func:`install` before it
first calls a kernel, then :func:`write_perf_map` once the kernels ran.

A cached kernel's library is loaded from its object file, whose symbol table gives every function's
offset and size; numba drops the object once loaded, so :func:`install` keeps a copy. A callee's code
appears once per process (the first library that defines it; the others' copies are weak symbols
resolved to it), so each function is named once whichever library it is in."""
from __future__ import annotations

import gc
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from numba.core import codegen

_KEPT = "_kept_object"


def install() -> None:
    """Keep each numba library's object code as it is loaded (call before the first kernel runs)."""
    cls: Any = codegen.CPUCodeLibrary
    if getattr(cls, "_jit_symbols_installed", False):
        return
    original = cls._set_compiled_object

    def keep(self: Any, value: bytes) -> None:
        setattr(self, _KEPT, value)
        original(self, value)

    cls._set_compiled_object, cls._jit_symbols_installed = keep, True


def short_name(symbol: str) -> str:
    """``module.function`` of a numba (Itanium-mangled) symbol: ``_ZN7kernels5model9simd_tile6_tilesB..``
    -> ``simd_tile._tiles``; other names as they are."""
    found = re.match(r"(?:__gufunc__\.|cfunc\.)?_ZN(\d.*)", symbol)
    if not found:
        return symbol
    rest, parts = found.group(1), []
    while rest[:1].isdigit():
        digits = re.match(r"\d+", rest)
        assert digits is not None
        size = int(digits.group(0))
        parts.append(rest[len(digits.group(0)):len(digits.group(0)) + size])
        rest = rest[len(digits.group(0)) + size:]
    return ".".join(parts[-2:])


def _object_symbols(obj: bytes) -> list[tuple[int, int, str, str]]:
    """(offset, size, nm type, name) of the functions an object file defines (``nm -S``)."""
    with tempfile.NamedTemporaryFile(suffix=".o") as f:
        f.write(obj)
        f.flush()
        out = subprocess.run(["nm", "-S", "--defined-only", f.name], capture_output=True, text=True,
                             check=False).stdout
    rows = [line.split(maxsplit=3) for line in out.splitlines()]  # a name may hold spaces
    return [(int(r[0], 16), int(r[1], 16), r[2], r[3]) for r in rows if len(r) == 4 and r[2] in "TtWw"]


def _library_lines(lib: Any) -> list[str]:
    """perf map lines of one library: from its kept object (offsets from one exported function's
    address), else from its LLVM module (sizes up to the next function)."""
    obj = getattr(lib, _KEPT, None)
    if obj is not None:
        symbols = _object_symbols(obj)
        for offset, _, kind, name in symbols:
            address = lib.get_pointer_to_function(name) if kind == "T" else 0
            if address:
                base = address - offset
                return [f"{base + o:x} {size:x} {short_name(n)}\n" for o, size, _, n in symbols]
        return []
    module = getattr(lib, "_final_module", None)
    if module is None:
        return []
    starts = sorted((lib.get_pointer_to_function(f.name), f.name) for f in module.functions if not f.is_declaration)
    starts = [(a, n) for a, n in starts if a]
    ends = [a for a, _ in starts[1:]] + [starts[-1][0] + 0x1000] if starts else []
    return [f"{a:x} {min(e - a, 0x40000):x} {short_name(n)}\n" for (a, n), e in zip(starts, ends, strict=True)]


def write_perf_map(path: Path | None = None) -> int:
    """Write the perf map of every numba library this process holds (default ``/tmp/perf-<pid>.map``):
    the number of functions named."""
    lines: list[str] = []
    for lib in [o for o in gc.get_objects() if isinstance(o, codegen.CPUCodeLibrary)]:
        lines += _library_lines(lib)
    target = path or Path(f"/tmp/perf-{os.getpid()}.map")
    target.write_text("".join(lines))
    return len(lines)


__all__ = ["install", "short_name", "write_perf_map"]
