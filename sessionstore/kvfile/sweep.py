"""Temporaries that name their owner, and the sweep that removes those no live process owns.

Every temporary the store and its commands create carries its owner in its name (FORMAT.md
section 5.1.1): ``<pid>-<start>-<boot>``, the creating process's id, its start time (field 22
of ``/proc/<pid>/stat``, clock ticks since boot) and the first 8 hex digits of the kernel's
boot id. A temporary is swept when its owner is dead: no such pid, or a pid with another start
time (a reused pid), or a zombie. A name without an owner (written by an older version) or one
from another boot or host is swept only once nothing in it changed for :data:`SWEEP_GRACE_S`.
A live owner's temporary is never touched. The sweeper first renames its victim to a name that
carries its OWN token (``sweep-<owner>-...``), so two sweepers never remove the same entry and
a sweeper killed half-way leaves debris the next sweep removes.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sessionstore.log import get_logger

log = get_logger("sweep")

SWEEP_GRACE_S = 3600.0  # an ownerless or foreign temporary untouched this long is debris
OWNER_PATTERN = r"(?P<pid>\d{1,10})-(?P<start>\d{1,20})-(?P<boot>[0-9a-f]{8})"
TMP_DIR_PREFIX = "t-"  # a temp dir of a new session, fork, import or slot (tmp/t-<owner>-...)
TRASH_PREFIX = "trash-"  # a deleted session being removed (tmp/trash-<owner>-<hex>-<id>)
REPLACED_PREFIX = "replaced-"  # a session swapped out by a replace (tmp/replaced-<owner>-<hex>-<id>)
CLAIM_PREFIX = "sweep-"  # an entry a sweeper took over (tmp/sweep-<owner>-<hex>)
_STORE_ENTRY_RE = re.compile(
    r"(?P<kind>t|trash|replaced|sweep)-" + OWNER_PATTERN + r"-(?P<rest>.+)\Z")
_LEGACY_STORE_RE = re.compile(r"(?:t-[A-Za-z0-9_]{8}|trash-.+-[0-9a-f]{8})\Z")  # no owner recorded


@dataclass(frozen=True)
class Owner:
    """The process a temporary belongs to."""

    pid: int
    start: int  # /proc/<pid>/stat field 22 (0 where /proc is absent)
    boot: str  # 8 hex digits of /proc/sys/kernel/random/boot_id ("00000000" where absent)

    @property
    def token(self) -> str:
        return f"{self.pid}-{self.start}-{self.boot}"

    def state(self) -> str:
        """One of "alive", "dead", "unknown" (another boot or host: liveness is not known here)."""
        if self.boot != _boot_id():
            return "unknown"
        started = process_start_time(self.pid)
        if started is None:
            return "dead"
        if self.start and started != self.start:
            return "dead"  # the pid was reused by a later process
        return "alive"


_BOOT: str | None = None
_ME: tuple[int, Owner] | None = None


def _boot_id() -> str:
    global _BOOT
    if _BOOT is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                _BOOT = f.read().strip().replace("-", "")[:8].lower() or "00000000"
        except OSError:
            _BOOT = "00000000"
    return _BOOT


def process_start_time(pid: int) -> int | None:
    """The start time of a live ``pid`` (0 where /proc is absent), None if it is dead or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return _kill_probe(pid)
    fields = raw[raw.rfind(b")") + 2:].split()  # after "pid (comm) ": field 3 (state) onward
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])  # field 22


def _kill_probe(pid: int) -> int | None:
    """0 (alive, start time unknown) or None (no such process), where /proc cannot be read."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, someone else's
        pass
    return 0


def current_owner() -> Owner:
    """This process (recomputed after a fork)."""
    global _ME
    pid = os.getpid()
    if _ME is None or _ME[0] != pid:
        _ME = (pid, Owner(pid, process_start_time(pid) or 0, _boot_id()))
    return _ME[1]


def owner_of(name: str) -> Owner | None:
    """The owner recorded in a temporary's name, or None when it records none."""
    m = re.search(OWNER_PATTERN, name)
    if m is None:
        return None
    return Owner(int(m["pid"]), int(m["start"]), m["boot"])


def store_entry_name(prefix: str, suffix: str = "") -> str:
    """``<prefix><owner>-<8 hex>[-<suffix>]``: a name under ``<root>/tmp/`` owned by this process."""
    name = f"{prefix}{current_owner().token}-{secrets.token_hex(4)}"
    return f"{name}-{suffix}" if suffix else name


def temp_beside(path: str | os.PathLike[str], suffix: str) -> str:
    """``<path>.<owner>-<8 hex><suffix>``: a temporary beside ``path`` owned by this process."""
    return f"{os.fspath(path)}.{current_owner().token}-{secrets.token_hex(4)}{suffix}"


@dataclass(frozen=True)
class Swept:
    """One temporary removed by a sweep."""

    path: str
    bytes: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _tree_stats(path: Path) -> tuple[int, float]:
    """(bytes of its files, newest mtime) of a file or a directory tree; links never followed."""
    st = os.lstat(path)
    total, newest = (0 if stat.S_ISDIR(st.st_mode) else st.st_size), st.st_mtime
    if stat.S_ISDIR(st.st_mode):
        for top, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    s = os.lstat(os.path.join(top, name))
                except FileNotFoundError:
                    continue
                total += 0 if stat.S_ISDIR(s.st_mode) else s.st_size
                newest = max(newest, s.st_mtime)
    return total, newest


def _verdict(owner: Owner | None, newest_mtime: float, now: float) -> str | None:
    """Why an entry is debris, or None to keep it."""
    state = "unknown" if owner is None else owner.state()
    if state == "alive":
        return None
    if state == "dead" and owner is not None:
        return f"owner pid {owner.pid} is gone"
    age = now - newest_mtime
    if age < SWEEP_GRACE_S:
        return None
    who = "no owner recorded" if owner is None else f"owner {owner.token} from another boot or host"
    return f"{who}, untouched for {int(age)} s"


def _remove(path: Path, claim_dir: Path | None, nbytes: int, reason: str) -> Swept | None:
    """Remove one temporary. A directory is first claimed: renamed into ``claim_dir`` under this
    process's own name, so no two sweepers remove it and a killed sweep leaves swept debris."""
    try:
        if claim_dir is None:
            os.unlink(path)  # a file goes in one step
        else:
            claimed = claim_dir / store_entry_name(CLAIM_PREFIX)
            os.rename(path, claimed)
            if stat.S_ISDIR(os.lstat(claimed).st_mode):
                shutil.rmtree(claimed, ignore_errors=True)
            else:
                os.unlink(claimed)
            if os.path.lexists(claimed):
                raise OSError(f"{claimed}: could not remove all of it")
    except FileNotFoundError:
        return None  # another sweeper got there first
    except OSError as exc:
        log.warning("temp.sweep_failed", path=str(path), error=str(exc))
        return None
    log.info("temp.swept", path=str(path), bytes=nbytes, reason=reason)
    return Swept(str(path), nbytes, reason)


def sweep_store_tmp(tmp_root: Path, sessions_root: Path) -> list[Swept]:
    """Remove the entries of a store's ``tmp/`` that no live process owns.

    A ``replaced-...-<id>`` directory (a session a killed replace took out) is kept, with a
    warning, while ``sessions/<id>`` is absent: it is the only copy of that session.
    """
    out: list[Swept] = []
    now = time.time()
    try:
        entries = sorted(os.listdir(tmp_root))
    except OSError as exc:  # absent or unreadable: nothing to sweep; the command goes on
        if not isinstance(exc, FileNotFoundError):
            log.warning("temp.sweep_failed", path=str(tmp_root), error=str(exc))
        return out
    for name in entries:
        path = tmp_root / name
        m = _STORE_ENTRY_RE.match(name)
        if m is None and not _LEGACY_STORE_RE.match(name):
            continue  # not a name of ours: never touched
        try:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                log.warning("temp.sweep_skipped", path=str(path), reason="a symlink, not ours")
                continue
            nbytes, newest = _tree_stats(path)
        except FileNotFoundError:
            continue
        owner = Owner(int(m["pid"]), int(m["start"]), m["boot"]) if m is not None else None
        reason = _verdict(owner, newest, now)
        if reason is None:
            continue
        if m is not None and m["kind"] == "replaced":
            session_id = m["rest"].partition("-")[2]
            if not os.path.lexists(sessions_root / session_id):
                log.warning("temp.sweep_kept", path=str(path), id=session_id,
                            reason=f"the only copy of session {session_id!r}; move it back to "
                                   f"{sessions_root / session_id}")
                continue
        swept = _remove(path, tmp_root, nbytes, reason)
        if swept is not None:
            out.append(swept)
    return out


def sweep_beside(path: str | os.PathLike[str], suffix: str, *, legacy: str | None = None) -> list[Swept]:
    """Remove temporaries ``<path>.<owner>-<8 hex><suffix>`` of dead owners beside ``path``, and
    the ownerless ``legacy`` pattern (a regex for the part after ``<path>.``) once stale."""
    target = Path(os.path.abspath(os.fspath(path)))
    directory, base = target.parent, target.name
    ours = re.compile(re.escape(base) + r"\." + OWNER_PATTERN + r"-[0-9a-f]{8}" + re.escape(suffix) + r"\Z")
    old = re.compile(re.escape(base) + r"\." + legacy + r"\Z") if legacy is not None else None
    out: list[Swept] = []
    now = time.time()
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in entries:
        m = ours.match(name)
        if m is None and (old is None or not old.match(name)):
            continue
        candidate = directory / name
        try:
            st = os.lstat(candidate)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue  # only regular files are ever ours here
        owner = Owner(int(m["pid"]), int(m["start"]), m["boot"]) if m is not None else None
        reason = _verdict(owner, st.st_mtime, now)
        if reason is None:
            continue
        swept = _remove(candidate, None, st.st_size, reason)
        if swept is not None:
            out.append(swept)
    return out


__all__ = ["process_start_time", "SWEEP_GRACE_S", "TMP_DIR_PREFIX", "TRASH_PREFIX", "REPLACED_PREFIX", "CLAIM_PREFIX",
           "Owner", "Swept", "current_owner", "owner_of", "store_entry_name", "temp_beside",
           "sweep_store_tmp", "sweep_beside"]
