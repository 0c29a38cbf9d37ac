"""The engine core's process, started first thing by ``coli-kv serve --http``.

A server is two processes, and each spends most of its start importing (numpy, numba and the
compiled kernels, the web stack): started one after the other they took about twice as long as
either. So :func:`tools.coli_kv.main` starts the core's process before it imports anything of
ours, the core imports beside the API process, and blocks reading its configuration from stdin;
:mod:`tools.cmd_serve` hands the process to the server, which writes the configuration when it
has one. A process nobody takes gets its stdin closed and exits at once (an empty configuration).

Standard library only: importing any package of ours first would be the wait this saves.
"""
from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from collections.abc import Sequence

CORE_MODULE = "sessionstore.service.engine.process"  # core_client.CORE_MODULE (a test holds them equal)

_started: subprocess.Popen[bytes] | None = None


SERVICE_MODULES = ("uvicorn", "starlette", "pydantic", "prometheus_client", "zmq", "msgspec", "httpx")


def wants_core(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (the CLI's, without the program) serves HTTP, ``serve ... --http ...``, with the
    service extra installed (without it the server says so in one line, and no core may start)."""
    if not (argv and argv[0] == "serve" and any(a == "--http" or a.startswith("--http=") for a in argv[1:])):
        return False
    try:  # found, not imported: a look at the path only
        return all(importlib.util.find_spec(name) is not None for name in SERVICE_MODULES)
    except (ImportError, ValueError):
        return False


def start() -> None:
    """Start the core's process (it imports, then waits for its configuration on stdin)."""
    global _started
    if _started is None:
        _started = subprocess.Popen([sys.executable, "-m", CORE_MODULE], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE)


def take() -> subprocess.Popen[bytes] | None:
    """The started process, handed over once (None: none was started, or it was taken)."""
    global _started
    proc, _started = _started, None
    return proc


def discard() -> None:
    """End a started process nobody took: its stdin closed, it exits without configuration."""
    proc = take()
    if proc is None:
        return
    assert proc.stdin is not None
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


__all__ = ["CORE_MODULE", "SERVICE_MODULES", "discard", "start", "take", "wants_core"]
