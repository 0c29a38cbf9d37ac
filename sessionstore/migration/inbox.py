"""An inbox directory that imports every bundle landing in it (``coli-kv serve --inbox DIR``).

Writers drop ``<name>.partial`` and rename it to its final name when complete (``coli-kv
export`` to a path does exactly that). The watcher imports every complete bundle present at
start, then every one that lands later (watchdog: a rename into the directory, or a file closed
after writing), one at a time, and moves it to ``DIR/done/`` or to ``DIR/failed/`` next to a
``<name>.reason`` file saying why (written with the safe create: a new regular file, never
through a symlink; a bundle that vanished mid-import gets its reason file in ``failed/`` too).
Names ending in ``.partial`` or ``.reason`` and hidden names are never touched. A failed import
leaves the store exactly as it was (see ``migrate``).
"""
from __future__ import annotations

import os
import queue
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler

from kernels.errors import ColiError
from sessionstore.kvfile import open_regular
from sessionstore.log import get_logger
from sessionstore.migration import migrate
from sessionstore.migration.bundle_io import WritebackFile
from sessionstore.migration.transport import PARTIAL_SUFFIX
from sessionstore.sessions import SessionStore, check_component

log = get_logger("inbox")

DONE_DIR = "done"
FAILED_DIR = "failed"
REASON_SUFFIX = ".reason"
POLL_S = 0.2


@dataclass(frozen=True)
class InboxOutcome:
    """What happened to one bundle."""

    name: str
    ok: bool
    moved_to: str
    session_id: str | None = None
    tokens: int | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def is_candidate(path: Path) -> bool:
    """A complete bundle name directly in the inbox (not partial, not a reason file, not hidden)."""
    name = path.name
    return not (name.startswith(".") or name.endswith(PARTIAL_SUFFIX) or name.endswith(REASON_SUFFIX))


class Inbox:
    """Imports bundles from ``directory`` into ``store``."""

    def __init__(self, store: SessionStore, directory: str | os.PathLike[str], *,
                 replace: bool = False, model: str | None = None) -> None:
        self.store = store
        self.dir = Path(directory).resolve()
        if not self.dir.is_dir():
            raise ColiError(f"{self.dir}: the inbox is not a directory")
        self.done = self.dir / DONE_DIR
        self.failed = self.dir / FAILED_DIR
        for d in (self.done, self.failed):
            if not check_component(d, want="dir"):  # a planted symlink is refused, never followed
                d.mkdir(exist_ok=False)
        self.replace = replace
        self.model = model
        self.outcomes: list[InboxOutcome] = []
        self._queue: queue.Queue[Path] = queue.Queue()
        self._queued: set[str] = set()
        self._lock = threading.Lock()

    # --- discovery -----------------------------------------------------------------------
    def offer(self, path: str | os.PathLike[str]) -> None:
        """Queue ``path`` if it is a complete bundle directly in the inbox (idempotent)."""
        p = Path(path)
        if p.parent.resolve() != self.dir or not is_candidate(p):
            return
        with self._lock:
            if p.name in self._queued:
                return
            self._queued.add(p.name)
        log.info("inbox.found", name=p.name)
        self._queue.put(p)

    def scan(self) -> int:
        """Queue every complete bundle present now; returns how many were queued."""
        before = self._queue.qsize()
        for entry in sorted(os.scandir(self.dir), key=lambda e: e.name):
            if entry.is_file(follow_symlinks=False):
                self.offer(self.dir / entry.name)
        return self._queue.qsize() - before

    # --- processing ------------------------------------------------------------------------
    def process(self, path: Path) -> InboxOutcome | None:
        """Import one bundle and move it to done/ or failed/ (None: it vanished meanwhile)."""
        with self._lock:
            self._queued.discard(path.name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return self._finish(path, False, reason=f"{path.name}: not a regular file")
        log.info("inbox.import_start", name=path.name, bytes=st.st_size)
        try:
            # the file lstat saw, or a refusal: a swap for a symlink, FIFO or device since is never read
            fd = open_regular(path, os.O_RDONLY, what="inbox bundle", same_as=st)
        except FileNotFoundError:
            return None
        except (ColiError, OSError) as exc:
            return self._finish(path, False, reason=f"{type(exc).__name__}: {exc}")
        try:
            with os.fdopen(fd, "rb", buffering=1 << 20) as source:
                result = migrate.import_bundle(self.store, source, source_name=str(path),
                                               replace=self.replace, model=self.model)
        except ColiError as exc:
            return self._finish(path, False, reason=f"{type(exc).__name__}: {exc}")
        except OSError as exc:
            return self._finish(path, False, reason=f"{type(exc).__name__}: {exc}")
        return self._finish(path, True, session_id=result.session_id, tokens=result.tokens)

    def _finish(self, path: Path, ok: bool, *, reason: str | None = None,
                session_id: str | None = None, tokens: int | None = None) -> InboxOutcome:
        target_dir = self.done if ok else self.failed
        target = _unique(target_dir / path.name)
        moved_to = target
        try:
            os.rename(path, target)
        except FileNotFoundError:
            moved_to = path  # removed under us: nothing to move; its reason still goes to failed/
        if not ok:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            _write_reason(Path(str(target) + REASON_SUFFIX), f"{stamp} {reason}\n")
            log.warning("inbox.import_failed", name=path.name, reason=reason,
                        moved_to=str(moved_to))
        else:
            log.info("inbox.import_done", name=path.name, id=session_id, tokens=tokens,
                     moved_to=str(moved_to))
        outcome = InboxOutcome(path.name, ok, str(moved_to), session_id, tokens, reason)
        self.outcomes.append(outcome)
        return outcome

    def drain(self) -> list[InboxOutcome]:
        """Process everything queued now (no waiting)."""
        out: list[InboxOutcome] = []
        while True:
            try:
                path = self._queue.get_nowait()
            except queue.Empty:
                return out
            outcome = self.process(path)
            if outcome is not None:
                out.append(outcome)

    # --- the long-running loop ---------------------------------------------------------------
    def run(self, stop: threading.Event, *, ready: threading.Event | None = None) -> list[InboxOutcome]:
        """Watch the inbox until ``stop`` is set; imports run one at a time in this thread."""
        from watchdog.observers import Observer

        observer = Observer()
        observer.schedule(_Handler(self), str(self.dir), recursive=False)
        observer.start()  # start watching BEFORE the first scan: nothing lands unseen
        log.info("inbox.start", inbox=str(self.dir), root=str(self.store.root))
        try:
            self.scan()
            if ready is not None:
                ready.set()
            while not stop.is_set():
                try:
                    path = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                self.process(path)
        finally:
            observer.stop()
            observer.join(timeout=5)
            log.info("inbox.stop", inbox=str(self.dir), imported=sum(o.ok for o in self.outcomes),
                     failed=sum(not o.ok for o in self.outcomes))
        return self.outcomes


class _Handler(FileSystemEventHandler):
    """watchdog handler: a rename into the inbox, or a file closed after writing."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox

    def dispatch(self, event: FileSystemEvent) -> None:
        if event.is_directory:
            return
        if event.event_type == "moved":
            self.inbox.offer(os.fsdecode(event.dest_path))
        elif event.event_type == "closed":
            self.inbox.offer(os.fsdecode(event.src_path))


def _unique(path: Path) -> Path:
    """``path``, or ``path.<i>``: a name free for a bundle AND its ``.reason`` file."""
    for i in range(10_000):
        candidate = path if i == 0 else path.with_name(f"{path.name}.{i}")
        if not (os.path.lexists(candidate) or os.path.lexists(str(candidate) + REASON_SUFFIX)):
            return candidate
    raise ColiError(f"{path}: too many bundles of this name")


def _write_reason(path: Path, text: str) -> None:
    """Write a reason file with the safe create (a new regular file, never through a symlink);
    a name taken meanwhile (a planted link) is refused and logged: the outcome keeps the reason."""
    try:
        with WritebackFile.create(path) as handle:
            handle.write(text.encode("utf-8", "replace"))
    except OSError as exc:
        log.warning("inbox.reason_refused", path=str(path), error=str(exc))


__all__ = ["Inbox", "InboxOutcome", "is_candidate", "DONE_DIR", "FAILED_DIR", "REASON_SUFFIX"]
