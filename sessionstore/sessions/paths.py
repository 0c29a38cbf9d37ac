"""Session ids and the paths they map to, confined to the store's root.

A session id is a plain name: ASCII letters, digits, ``.``, ``_`` and ``-``, starting with a
letter or digit, at most ``MAX_ID_LENGTH`` characters. It can never be ``.``/``..``, hold a
separator or a control character, or be empty. Every path the store builds is
``<root>/<area>/<name>`` with ``root`` resolved once; components under the root must be real
directories or regular files: a symlink anywhere below the root is refused, so nothing the
store touches can escape it.
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from kernels.errors import FormatError, LimitError, NotFoundError

MAX_ID_LENGTH = 128
KV_NAME = "kv.coli_kv"  # the names inside a session directory (FORMAT.md 5.1)
SIDECAR_NAME = KV_NAME + ".colisum"
LOCK_NAME = KV_NAME + ".lock"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")


class InvalidSessionIdError(FormatError):
    """A session id that is not a plain, confined name."""


def validate_session_id(session_id: object) -> str:
    """Return ``session_id`` if it is a valid id; raise InvalidSessionIdError/LimitError if not."""
    if not isinstance(session_id, str):
        raise InvalidSessionIdError(f"session id must be a string, found {type(session_id).__name__}")
    if len(session_id) > MAX_ID_LENGTH:
        raise LimitError(
            f"session id of {len(session_id)} characters exceeds the limit {MAX_ID_LENGTH}")
    if not _ID_RE.match(session_id):
        shown = session_id.encode("unicode_escape").decode("ascii")[:80]
        raise InvalidSessionIdError(
            f"invalid session id {shown!r}: use letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (no separators, no '..', no control characters)")
    return session_id


def is_valid_session_id(session_id: object) -> bool:
    try:
        validate_session_id(session_id)
    except (InvalidSessionIdError, LimitError):
        return False
    return True


def resolve_root(root: str | os.PathLike[str], *, create: bool = True) -> Path:
    """The store's root as an absolute, resolved path (created when ``create``)."""
    path = Path(os.fspath(root)).expanduser()
    if path.exists() and not path.is_dir():
        raise FormatError(f"store root {path} is not a directory (it exists as another kind of file)")
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise FormatError(f"store root {path} is not a directory") from None
        except NotADirectoryError:
            raise FormatError(f"store root {path}: a component of the path is not a directory") from None
        except OSError as exc:
            raise FormatError(f"store root {path}: cannot create it ({exc.strerror})") from None
    if not path.is_dir():
        raise NotFoundError(f"store root {path} is not a directory (it does not exist)")
    return path.resolve(strict=True)


def check_component(path: Path, *, want: str) -> bool:
    """True if ``path`` exists as ``want`` ('dir' or 'file'); False if absent.

    Refuses (FormatError) a symlink or anything of another kind; never follows links.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise FormatError(f"{path}: is a symlink; refusing it (paths must stay inside the store)")
    ok = stat.S_ISDIR(st.st_mode) if want == "dir" else stat.S_ISREG(st.st_mode)
    if not ok:
        raise FormatError(f"{path}: expected a {'directory' if want == 'dir' else 'regular file'}")
    return True


def confined(root: Path, *names: str) -> Path:
    """``root / names...`` after checking every name is one plain component inside ``root``.

    Existing intermediate components must be real directories (not symlinks).
    """
    path = root
    for i, name in enumerate(names):
        if not name or name in (".", "..") or "/" in name or "\0" in name or os.sep in name:
            raise InvalidSessionIdError(f"path component {name!r} is not a plain name")
        path = path / name
        if i < len(names) - 1:
            check_component(path, want="dir")
    if os.path.commonpath([root, path]) != str(root):  # belt and braces
        raise InvalidSessionIdError(f"{path} escapes the store root {root}")
    return path


__all__ = [
    "MAX_ID_LENGTH", "KV_NAME", "SIDECAR_NAME", "LOCK_NAME", "InvalidSessionIdError", "validate_session_id",
    "is_valid_session_id", "resolve_root", "check_component", "confined",
]
