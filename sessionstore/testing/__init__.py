"""Fault injection for the store's tests (the package's ``testing`` kit, kept out of production
modules): a :class:`FaultyDurability` that fails (``OSError``) or "crashes" (:class:`SimulatedCrash`,
and every later step crashes too) at step ``k``, optionally dropping writes that were never fsynced
(a power-loss model), so a test can check that the files on disk reopen to a committed prefix;
:func:`count_steps` tells how many steps a scenario takes."""
from __future__ import annotations

import errno
import os
import random
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from sessionstore.kvfile import Buffer, Durability

T = TypeVar("T")


class SimulatedCrash(Exception):
    """Raised by :class:`FaultyDurability` at the crash step and at every step after it."""



class FaultyDurability(Durability):
    """Counts steps; at step ``fail_at`` (0-based) fails or crashes.

    - ``mode="error"``: that one step raises ``OSError(EIO)`` without doing anything; later steps
      work again (a transient disk error).
    - ``mode="crash"``: that step and every later one raise :class:`SimulatedCrash` (the process
      is "dead"; nothing more reaches the disk). With ``lose_unsynced=True`` the crash also
      rolls every file written through this object back to its last fsynced content plus a random
      subset (seeded by ``seed``) of the writes made since (a power cut). Renames are taken as
      durable at once (a simplification: the writer fsyncs the directory right after each).
    - ``only``: count only these step names (e.g. ``{"fsync"}``); other steps run untouched.
    - ``real_sync=False`` skips the real fsync system calls (faster; nothing dies for real).
    ``steps`` lists the step names seen, so a first clean run tells how many steps a scenario has.
    """

    STEP_NAMES = ("open", "pwrite", "fsync", "replace", "fsync_dir", "unlink")

    def __init__(self, fail_at: int | None = None, *, mode: str = "crash",
                 only: set[str] | None = None, lose_unsynced: bool = False, seed: int = 0,
                 real_sync: bool = False) -> None:
        super().__init__()
        if mode not in ("error", "crash"):
            raise ValueError(f"mode must be 'error' or 'crash', not {mode!r}")
        self.fail_at = fail_at
        self.mode = mode
        self.only = only
        self.lose_unsynced = lose_unsynced
        self.rng = random.Random(seed)
        self.real_sync = real_sync
        self.steps: list[str] = []
        self.crashed = False
        self.failed_step: str | None = None
        self._count = 0
        self._lock = threading.Lock()
        self._fd_path: dict[int, str] = {}
        self._synced: dict[str, bytes] = {}  # path -> content at its last fsync
        self._journal: dict[str, list[tuple[int, bytes]]] = {}  # path -> writes since

    def _step(self, name: str) -> None:
        with self._lock:
            if self.crashed:
                raise SimulatedCrash(f"after crash: {name}")
            if self.only is not None and name not in self.only:
                return
            index = self._count
            self._count += 1
            self.steps.append(name)
            if index != self.fail_at:
                return
            self.failed_step = name
            if self.mode == "error":
                raise OSError(errno.EIO, f"injected I/O error at step {index} ({name})")
            self.crashed = True
        if self.lose_unsynced:
            self._power_cut()
        raise SimulatedCrash(f"crash at step {index} ({name})")

    # -- journal for the power-loss model -----------------------------------------------------------
    def _track(self, fd: int, path: str, created: bool) -> None:
        self._fd_path[fd] = path
        if path not in self._synced:
            try:
                with open(path, "rb") as f:
                    self._synced[path] = b"" if created else f.read()
            except OSError:
                self._synced[path] = b""
            self._journal[path] = []

    def _power_cut(self) -> None:
        for path, writes in self._journal.items():
            content = bytearray(self._synced[path])
            for offset, data in writes:
                if self.rng.random() < 0.5:
                    continue  # this write never reached the disk
                end = offset + len(data)
                if len(content) < end:
                    content.extend(b"\0" * (end - len(content)))
                content[offset:end] = data
            if os.path.exists(path):
                with open(path, "r+b") as f:
                    f.truncate(0)
                    f.write(content)

    # -- the steps ----------------------------------------------------------------------------
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._step("open")
        existed = os.path.exists(path)
        fd = super().open(path, flags, mode)
        self._track(fd, path, created=not existed or bool(flags & os.O_TRUNC))
        return fd

    def pwrite(self, fd: int, data: Buffer, offset: int) -> None:
        self._step("pwrite")
        super().pwrite(fd, data, offset)
        path = self._fd_path.get(fd)
        if path is not None:
            self._journal[path].append((offset, bytes(data)))

    def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int) -> None:
        self._step("pwrite")
        Durability.pwritev(self, fd, buffers, offset)
        path = self._fd_path.get(fd)
        if path is not None:
            for buf in buffers:
                self._journal[path].append((offset, bytes(buf)))
                offset += len(buf)

    def fsync(self, fd: int) -> None:
        self._step("fsync")
        if self.real_sync:
            os.fdatasync(fd)
        path = self._fd_path.get(fd)
        if path is not None:
            with open(path, "rb") as f:
                self._synced[path] = f.read()
            self._journal[path] = []

    def begin(self, fn: Callable[..., T], *args: object) -> Callable[[], T]:
        result = fn(*args)  # at once, in this thread: step numbers stay deterministic
        return lambda: result

    def fsync_all(self, fds: Sequence[int]) -> None:
        for fd in fds:
            self.fsync(fd)

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        pass  # a hint only: the power-cut model must not treat it as a barrier

    def replace(self, src: str, dst: str) -> None:
        self._step("replace")
        os.replace(src, dst)
        if src in self._synced:
            self._synced[dst] = self._synced.pop(src)
            self._journal[dst] = self._journal.pop(src)
            for fd, path in self._fd_path.items():
                if path == src:
                    self._fd_path[fd] = dst

    def fsync_dir(self, path: str) -> None:
        self._step("fsync_dir")
        if self.real_sync:
            Durability.fsync_dir(self, path)

    def unlink(self, path: str) -> None:
        self._step("unlink")
        os.unlink(path)
        self._synced.pop(path, None)
        self._journal.pop(path, None)



def count_steps(scenario: Callable[[Durability], object], **kwargs: object) -> list[str]:
    """Run ``scenario`` with a counting (never failing) FaultyDurability; the step names it took."""
    probe = FaultyDurability(None, **kwargs)  # type: ignore[arg-type]
    scenario(probe)
    return probe.steps


__all__ = ["FaultyDurability", "SimulatedCrash", "count_steps"]
