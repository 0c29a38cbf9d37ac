"""numba's on-disk cache of this package's kernels dropped when any of the package's sources changed.

numba (``cache=True``) keys a function's cached machine code on its OWN source file's stamp only: a
kernel that calls (and so compiles in) a function of another module keeps its cached code when only
that other module changes. A working tree upgraded in place (``git pull``) then runs the old callee's
code inside the new caller: wrong results, not a crash (seen after an edit to ``panel_tiles.py``, a
callee of the compiled step). So the package keeps one stamp of all its sources (each ``.py`` file's
path, size and mtime), beside numba's cache, and drops every cache file of the package's kernels when
the stamp differs (or is missing: caches of unknown provenance). The next use compiles afresh.

It runs once per process, from ``kernels/__init__.py``, before any kernel module is imported; it
imports nothing of numba (a process that never computes pays ~1 ms of ``stat`` calls). Where numba
puts the cache: each source folder's ``__pycache__`` by default, or under ``$NUMBA_CACHE_DIR`` a
folder named ``<folder name>_<sha1 of its absolute path>`` (numba's ``get_suitable_cache_subpath``).
Two processes that start together after an upgrade may both drop the caches: that costs a compile,
never a wrong result (numba treats a missing cache file as a miss).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

CACHE_SUFFIXES = (".nbi", ".nbc")  # numba's index and data files


def sources_stamp(package: Path) -> str:
    """One line per ``.py`` file under ``package``: relative path, size, mtime (ns); sorted."""
    rows = []
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        st = path.stat()
        rows.append(f"{path.relative_to(package).as_posix()} {st.st_size} {st.st_mtime_ns}")
    return "\n".join(rows) + "\n"


def cache_folders(package: Path, cache_dir: str | None) -> list[Path]:
    """Where numba keeps the cache files of ``package``'s source folders."""
    folders = sorted({p.parent.resolve() for p in package.rglob("*.py") if "__pycache__" not in p.parts})
    if cache_dir:
        return [Path(cache_dir) / f"{d.name}_{hashlib.sha1(str(d).encode()).hexdigest()}" for d in folders]
    return [d / "__pycache__" for d in folders]


def stamp_path(package: Path, cache_dir: str | None) -> Path:
    """The stamp's file: in the package's ``__pycache__``, or in ``$NUMBA_CACHE_DIR`` (named by the package's path)."""
    if cache_dir:
        key = hashlib.sha1(str(package.resolve()).encode()).hexdigest()[:16]
        return Path(cache_dir) / f"coli-kernels-{key}.stamp"
    return package / "__pycache__" / "coli-kernels.stamp"


def refresh_stale_caches(package: Path, cache_dir: str | None) -> bool:
    """Drop ``package``'s numba cache files when its sources' stamp differs from the one kept; keep the
    new stamp. True when it dropped them. A folder it cannot write (a read-only install) is left as is."""
    stamp, where = sources_stamp(package), stamp_path(package, cache_dir)
    try:
        if where.read_text() == stamp:
            return False
    except (OSError, UnicodeDecodeError):
        pass  # no stamp yet, or unreadable: caches of unknown provenance
    try:
        for folder in cache_folders(package, cache_dir):
            if folder.is_dir():
                for entry in folder.iterdir():
                    if entry.suffix in CACHE_SUFFIXES:
                        entry.unlink(missing_ok=True)
        where.parent.mkdir(parents=True, exist_ok=True)
        partial = where.with_name(f"{where.name}.{os.getpid()}.tmp")
        partial.write_text(stamp)
        os.replace(partial, where)  # whole or absent: a cache, no fsync needed
    except OSError:
        return False
    return True


__all__ = ["CACHE_SUFFIXES", "cache_folders", "refresh_stale_caches", "sources_stamp", "stamp_path"]
