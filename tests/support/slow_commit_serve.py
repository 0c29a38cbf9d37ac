"""``python -m tests.support.slow_commit_serve ARGS...``: ``coli-kv ARGS`` (a real server) whose engine
core sleeps ``$COLI_TEST_SLOW_FSYNC_S`` seconds (default 0.3) before each fsync of a session's kv files
(the durability seam, :class:`sessionstore.kvfile.durability.Durability`) and ``$COLI_TEST_SLOW_LIST_S``
(default 1.0) before the directory fsync that follows the rename of a session's ``responses.json`` (a
conversation's items, visible from the rename on: a client polling them has that long to act). A turn's
commit after its reply, and its conversation's write, then hold the session's claim that long: a client's
next request, sent at once, always arrives while the turn that answered it still commits (the server
starts its core as this module too, which then runs the core)."""
from __future__ import annotations

import os
import sys
import time

from sessionstore.kvfile import fsio
from sessionstore.kvfile.durability import Durability
from sessionstore.sessions.response_list import RESPONSES_NAME

SLOW_S = float(os.environ.get("COLI_TEST_SLOW_FSYNC_S", "0.3"))
SLOW_LIST_S = float(os.environ.get("COLI_TEST_SLOW_LIST_S", "1.0"))
ROLE_ENV = "COLI_TEST_SLOW_ROLE"

real_fsync, real_fsync_parent = Durability.fsync, fsio.fsync_parent


def _in_sessions(fd: int) -> bool:
    try:
        return f"{os.sep}sessions{os.sep}" in os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False


def fsync(self: Durability, fd: int) -> None:
    if _in_sessions(fd):
        time.sleep(SLOW_S)
    real_fsync(self, fd)


def fsync_parent(path: str | os.PathLike[str]) -> None:
    where = os.fspath(path)
    if f"{os.sep}sessions{os.sep}" in where and os.path.basename(where) == RESPONSES_NAME:
        time.sleep(SLOW_LIST_S)
    real_fsync_parent(path)


Durability.fsync = fsync  # type: ignore[method-assign]
fsio.fsync_parent = fsync_parent  # atomic_replace's directory fsync (looked up in its module)

if __name__ == "__main__":
    if os.environ.get(ROLE_ENV) == "core":  # the engine core, where the commits run
        from sessionstore.service.engine.process import main as core_main

        sys.exit(core_main())
    from sessionstore.service.http import core_client
    from tools.coli_kv import main

    os.environ[ROLE_ENV] = "core"  # the core process this server starts runs this module too
    core_client.CORE_MODULE = "tests.support.slow_commit_serve"
    sys.exit(main())
