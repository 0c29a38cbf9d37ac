"""``python -m tests.support.eio_serve ARGS...``: ``coli-kv ARGS`` (a real server) with one EIO injected
through the durability seam (:class:`sessionstore.kvfile.durability.Durability`) of its engine core
(the server starts its core as this module too, which then runs the core).

``$COLI_TEST_EIO_SESSION``: the session whose kv file fails; ``$COLI_TEST_EIO_AFTER``: the fsync that
follows that file's Nth commit word (a ``pwrite`` at the commit word's offset) fails once with EIO,
the word already in the page cache: the case where a reader of the page cache would see records
the disk may not hold. Every fsync of the session's files through the seam is appended to
``$COLI_TEST_EIO_LOG`` as ``<file name> ok|EIO`` (the test checks none follows the failure until
the session is reopened)."""
from __future__ import annotations

import errno
import os
import sys
import threading
from pathlib import Path

from sessionstore.kvfile.durability import Durability
from sessionstore.kvfile.fsio import Buffer
from sessionstore.kvfile.header import NREC_OFFSET

SESSION = os.environ.get("COLI_TEST_EIO_SESSION", "")
AFTER = int(os.environ.get("COLI_TEST_EIO_AFTER", "0"))
LOG = os.environ.get("COLI_TEST_EIO_LOG", "")

_lock = threading.Lock()
_words = 0  # commit words written to the target kv file
_armed_fd: int | None = None  # the fd whose next fsync fails
_fired = False


def _target(fd: int) -> Path | None:
    """The file behind ``fd`` when it is one of the target session's, else None."""
    try:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None
    return path if path.parent.name == SESSION and path.parent.parent.name == "sessions" else None


real_pwrite, real_fsync = Durability.pwrite, Durability.fsync


def pwrite(self: Durability, fd: int, data: Buffer, offset: int) -> None:
    global _words, _armed_fd
    real_pwrite(self, fd, data, offset)
    path = _target(fd)
    if path is not None and path.suffix == ".coli_kv" and offset == NREC_OFFSET:
        with _lock:
            _words += 1
            if _words == AFTER and not _fired:
                _armed_fd = fd


def fsync(self: Durability, fd: int) -> None:
    global _fired, _armed_fd
    path = _target(fd)
    if path is None:
        real_fsync(self, fd)
        return
    with _lock:
        fail = fd == _armed_fd and not _fired
        if fail:
            _fired, _armed_fd = True, None
    if not fail:
        real_fsync(self, fd)
    if LOG:
        with open(LOG, "a") as log:
            log.write(f"{path.name} {'EIO' if fail else 'ok'}\n")
    if fail:
        raise OSError(errno.EIO, "Input/output error (injected)")


Durability.pwrite = pwrite  # type: ignore[method-assign]
Durability.fsync = fsync  # type: ignore[method-assign]

if __name__ == "__main__":
    if os.environ.get("COLI_TEST_EIO_ROLE") == "core":  # the engine core, where the commits run
        from sessionstore.service.engine.process import main as core_main

        sys.exit(core_main())
    from sessionstore.service.http import core_client
    from tools.coli_kv import main

    os.environ["COLI_TEST_EIO_ROLE"] = "core"  # the core process this server starts runs this module too
    core_client.CORE_MODULE = "tests.support.eio_serve"
    sys.exit(main())
