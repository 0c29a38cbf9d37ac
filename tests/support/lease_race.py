"""One host of a lease race (tests/migration/test_real_store.py), run as a forked process: the
race's hosts start in milliseconds, with everything the test process imported already loaded.

For each session id, once every host is at the barrier, it does what a turn through the fleet
does for an id the fleet has no bundle of (``RemoteStore.begin_turn``): take the lease first (the
conditional create), and only if that won create the session locally and push it, keeping the
lease. It puts one answer per id on ``answers``: ``(host, {"won": true, "generation", "bundle"})``
or ``(host, {"won": false, "error", "kind"})``, each with whether a local copy exists after.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from kernels.errors import LockedError
from sessionstore.migration.remote import RemoteStore
from sessionstore.sessions.store import SessionStore
from tests.support.migrate import make_session


def race_host(url: str, root: Path, host: str, session_ids: list[str], barrier: Any, answers: Any) -> None:
    remote = RemoteStore(SessionStore(root), url, host_id=host)
    remote.list()  # connected before the first round
    for session_id in session_ids:
        barrier.wait()
        out: dict[str, Any]
        try:
            remote.acquire(session_id)
            make_session(remote.store, session_id, 12)
            _, held = remote.push(session_id, release=False)
            out = {"won": True, "generation": held.generation, "bundle": held.bundle}
        except LockedError as exc:
            out = {"won": False, "error": str(exc), "kind": type(exc).__name__}
        except Exception as exc:  # reported to the test, which fails on it
            out = {"won": False, "error": repr(exc), "kind": type(exc).__name__}
        out["local"] = remote.store.exists(session_id)
        answers.put((host, out))


__all__ = ["race_host"]
