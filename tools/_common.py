"""Helpers more than one ``coli-kv`` command uses: argument parsing, the backend check, the push
after a turn, the verify line, and the store a command creates (and removes again on failure).

Command modules import these from here, never from each other. The session layer is imported
only by the helpers that need it (and the engine loop every turn runs on, :mod:`tools._core`).
"""
from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kernels.errors import BackendUnavailableError, ColiError, FormatError

if TYPE_CHECKING:
    from sessionstore.kvfile import VerifyReport
    from sessionstore.sessions import SessionStore

MAX_PROMPT_IDS = 1 << 20
_ID = re.compile(r"-?[0-9]+")  # ASCII digits only: int() would also take '1_0' and other scripts' digits


def parse_ids(text: str) -> list[int]:
    """'1, 2,3' -> [1, 2, 3]; anything else is one clear error."""
    items = [s.strip() for s in text.split(",")]
    if text.strip() == "" or any(s == "" for s in items):
        raise FormatError(f"--prompt-ids: expected comma-separated integers, found {text!r}")
    if len(items) > MAX_PROMPT_IDS:
        raise FormatError(f"--prompt-ids: more than {MAX_PROMPT_IDS} ids")
    for s in items:
        if not _ID.fullmatch(s):
            raise FormatError(f"--prompt-ids: {s!r} is not an integer")
    return [int(s) for s in items]


def check_backend(name: str) -> None:
    """Refuse an unusable backend in one line, before any model is loaded or session touched."""
    if name == "cpu":
        return
    from kernels.backend import get_backend

    try:
        get_backend(name)
    except BackendUnavailableError as exc:
        raise BackendUnavailableError(f"{exc}; or run on the CPU with --backend cpu") from None


def push_turn(remote: Any, session_id: str, keep_lease: bool) -> tuple[dict[str, Any], ColiError | None]:
    """Push a committed turn to the fleet: (the JSON ``remote`` member, the push's error or None).

    A failed push never hides the turn: the caller prints the tokens (they are committed on this
    host), then the error as its one line. The member says what the fleet has: ``pushed`` true
    with the bundle, or false with the error."""
    where = {"url": remote.url, "host": remote.host_id}
    try:
        _, lease = remote.push(session_id, release=not keep_lease)
    except ColiError as exc:
        return {**where, "pushed": False, "error": str(exc)}, exc
    return {**where, "pushed": True, "bundle": lease.bundle, "generation": lease.generation,
            "lease": "held" if keep_lease else "released"}, None


def unsound_line(report: VerifyReport) -> str:
    """The one stderr line for an unsound file: its path, the first problem, how many more."""
    first = report.problems[0] if report.problems else "no detail"
    more = len(report.problems) - 1
    where = "" if str(report.path) in first else f"{report.path}: "
    return f"{where}UNSOUND: {first}" + (f" (+{more} more problem(s))" if more > 0 else "")


SKELETON = ("tmp", "sessions")  # a store's directories; "." names its root


def existing_skeleton(root: str) -> frozenset[str]:
    """The parts of a store at ``root`` that exist now: "." (the root), "tmp", "sessions"."""
    path = os.path.expanduser(root)
    return frozenset(name for name in (".", *SKELETON) if os.path.lexists(os.path.join(path, name)))


def remove_empty_store(root: str, *, keep: frozenset[str] = frozenset()) -> None:
    """Undo the empty store skeleton (``tmp/``, ``sessions/``, the root) a failed command created.

    Only a skeleton that holds nothing at all goes: a store whose ``sessions/`` or ``tmp/`` has
    any entry (a session committed before the failure, another command's temp dir) is left
    whole, so every command still accepts it (FORMAT.md 5.1.1). rmdir never removes data.
    ``keep``: the parts that existed before the command (see existing_skeleton); they stay, and
    what they hold does not matter.
    """
    parts = [(sub, os.path.join(root, sub)) for sub in SKELETON]  # a lone sessions/ is repaired
    try:
        if any(os.listdir(p) for sub, p in parts if sub not in keep and os.path.isdir(p)):
            return
    except OSError:
        return
    from sessionstore.sessions import CATALOGUE_NAME

    if "sessions" not in keep:  # the catalogue of a store this command made lists nothing (FORMAT.md 5.9)
        for suffix in ("", "-wal", "-shm"):
            try:
                os.unlink(os.path.join(root, CATALOGUE_NAME + suffix))
            except FileNotFoundError:
                pass
            except OSError:
                return
    for name, path in (*parts, (".", root)):
        if name in keep:
            continue
        try:
            os.rmdir(path)
        except FileNotFoundError:
            continue
        except OSError:
            return


@contextlib.contextmanager
def fresh_store(root: str, *, keep_on_success: bool = True) -> Iterator[SessionStore]:
    """The store at ``root``, created if absent; a store this command created is removed again
    when the command fails (or always, with ``keep_on_success=False``: nothing was stored).

    A root that was no store (absent, or a directory without ``sessions/``, empty or not) loses
    exactly the skeleton parts the command made, never a directory that existed before."""
    from sessionstore.sessions import SessionStore

    before = existing_skeleton(root)
    fresh = "sessions" not in before
    store = SessionStore(root)
    try:
        yield store
    except BaseException:
        if fresh:
            remove_empty_store(str(store.root), keep=before)
        raise
    if fresh and not keep_on_success:
        remove_empty_store(str(store.root), keep=before)


__all__ = [
    "MAX_PROMPT_IDS",
    "check_backend",
    "existing_skeleton",
    "fresh_store",
    "parse_ids",
    "push_turn",
    "remove_empty_store",
    "unsound_line",
]
