"""Recording the file-system operations a protocol issues, for the crash-state explorer
(``tests/support/crash_states.py``; FORMAT.md 3.9).

The store's durability seam (:class:`sessionstore.kvfile.durability.Durability`) carries the kv
file's writes and barriers, but the sidecar, the create / convert / copy paths and the session
files call the ``os`` primitives of :mod:`sessionstore.kvfile.fsio` directly. So the recorder
sits one level lower, where every one of them passes (ALICE's approach: trace the system
calls): while a :class:`Recorder` is active it wraps ``os.open``, ``write``, ``pwrite``,
``pwritev``, ``ftruncate``, ``fsync``, ``fdatasync``, ``replace``, ``rename``, ``unlink``,
``remove``, ``link``, ``mkdir``, ``rmdir``, ``copy_file_range`` and ``sendfile``, runs the real
call, and appends an :class:`Op` about the files under its root to :attr:`Recorder.ops`.

Files are named by model inode numbers (a create, or a file present when recording started), so
a write through a descriptor of a renamed or unlinked file stays with that file. A barrier
records the op index at which it STARTED (``covers``): only what was recorded before it is
durable by it (a write racing with an fsync on a helper thread is not). A write the recorder
cannot see (a builtin ``open().write``, an mmap store) is caught afterwards:
:meth:`Recorder.check_replay` rebuilds the final tree from the snapshot and the ops and compares
it with the real one, byte for byte. ``fsio.open_regular`` binds ``os.open`` as its default
opener at import, so that default is swapped too while recording.
"""
from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sessionstore.kvfile.fsio import open_regular

Entry = tuple[int, str]  # (directory inode, name)


@dataclass(frozen=True)
class Op:
    """One recorded operation. ``kind`` is one of:

    - ``write`` (``ino``, ``offset``, ``data``), ``trunc`` (``ino``, ``size``): file data;
    - ``sync`` (``ino``, ``covers``): fsync / fdatasync of a file;
    - ``dsync`` (``ino`` = the directory, ``covers``): fsync of a directory;
    - ``create`` / ``mkdir`` (``dst``, ``ino``), ``link`` (``dst``, ``ino``), ``unlink`` / ``rmdir``
      (``src``), ``rename`` (``src``, ``dst``): names;
    - ``mark`` (``label``, ``value``): a point the protocol noted (e.g. a commit acknowledged).
    """

    kind: str
    ino: int = -1
    offset: int = 0
    data: bytes = b""
    size: int = 0
    covers: int = 0
    src: Entry | None = None
    dst: Entry | None = None
    label: str = ""
    value: int = 0

    def dirs(self, *, both: bool = False) -> tuple[int, ...]:
        """The directories whose fsyncs make this name operation durable (empty for data
        operations): the one a name is made in (create, mkdir, link, and a rename's
        destination: a rename is atomic, and durable once the directory it names the file in
        is fsynced), or the one it is removed from (unlink, rmdir). ``both``: a rename across
        directories needs its source directory's fsync too (the stricter reading of POSIX)."""
        if self.kind not in NAME_KINDS:
            return ()
        if both and self.src is not None and self.dst is not None:
            return tuple(sorted({self.src[0], self.dst[0]}))
        entry = self.dst if self.dst is not None else self.src
        assert entry is not None
        return (entry[0],)


NAME_KINDS = frozenset({"create", "mkdir", "link", "unlink", "rmdir", "rename"})
DATA_KINDS = frozenset({"write", "trunc"})


@dataclass
class Snapshot:
    """The tree under the root when recording started, taken as durable: directories
    (inode -> {name: inode}) and files (inode -> bytes). Inode 0 is the root."""

    dirs: dict[int, dict[str, int]] = field(default_factory=dict)
    files: dict[int, bytes] = field(default_factory=dict)


def unmodelled(name: str) -> bool:
    """A file the explorer leaves out: the store's SQLite session catalogue (its own write-ahead log,
    written by SQLite's C code, which no os-level wrapper sees; a cache the store rebuilds from the
    session files when it is missing or damaged, FORMAT.md 5.9), so every state is built without it."""
    return name.startswith("catalogue.sqlite3")


class Recorder:
    """Records the operations on files under ``root`` while active (``with recorder.active():``);
    the catalogue's files (:func:`unmodelled`) are outside the record."""

    _PATCHED = ("open", "write", "pwrite", "pwritev", "ftruncate", "fsync", "fdatasync", "replace",
                "rename", "unlink", "remove", "link", "mkdir", "rmdir", "copy_file_range", "sendfile")

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.realpath(os.fspath(root))
        self.ops: list[Op] = []
        self.snapshot = Snapshot()
        self._next_ino = 0
        self._real_ino: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) -> model inode
        self._names: dict[int, dict[str, int]] = {}  # the live namespace, mirrored
        self._lock = threading.RLock()
        self._take_snapshot()

    # -- the namespace ----------------------------------------------------------------------------
    def _new_ino(self, real: os.stat_result) -> int:
        ino = self._next_ino
        self._next_ino += 1
        self._real_ino[(real.st_dev, real.st_ino)] = ino
        return ino

    def _take_snapshot(self) -> None:
        root_ino = self._new_ino(os.lstat(self.root))
        self._names[root_ino] = {}
        stack = [(self.root, root_ino)]
        while stack:
            path, ino = stack.pop()
            for name in sorted(os.listdir(path)):
                if unmodelled(name):
                    continue
                child = os.path.join(path, name)
                st = os.lstat(child)
                if stat.S_ISDIR(st.st_mode):
                    cino = self._new_ino(st)
                    self._names[cino] = {}
                    stack.append((child, cino))
                elif stat.S_ISREG(st.st_mode):
                    cino = self._new_ino(st)
                    with open(child, "rb") as f:
                        self.snapshot.files[cino] = f.read()
                else:
                    continue  # sockets, links: nothing the store writes
                self._names[ino][name] = cino
        self.snapshot.dirs = {d: dict(e) for d, e in self._names.items()}

    def _entry(self, path: Any) -> Entry | None:
        """(directory inode, name) of ``path`` when it lies under the root, else None."""
        if not isinstance(path, (str, bytes, os.PathLike)):
            return None
        full = os.path.abspath(os.fsdecode(os.fspath(path)))
        parent = os.path.realpath(os.path.dirname(full))
        if parent != self.root and not parent.startswith(self.root + os.sep):
            return None
        if unmodelled(os.path.basename(full)):
            return None
        ino = 0
        rel = os.path.relpath(parent, self.root)
        for part in ([] if rel == "." else rel.split(os.sep)):
            nxt = self._names.get(ino, {}).get(part)
            if nxt is None or nxt not in self._names:
                return None
            ino = nxt
        return ino, os.path.basename(full)

    def _fd_ino(self, fd: int) -> int | None:
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        return self._real_ino.get((st.st_dev, st.st_ino))

    def _add(self, op: Op) -> None:
        self.ops.append(op)

    # -- the wrapped calls ------------------------------------------------------------------------
    def _wrap(self, real: dict[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
        rec = self

        def w_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
            assert dir_fd is None, "dir_fd opens are not recorded"
            with rec._lock:
                entry = rec._entry(path)
                existed = entry is not None and entry[1] in rec._names.get(entry[0], {})
                fd = real["open"](path, flags, mode)
                if entry is None:
                    return fd
                st = os.fstat(fd)
                if not existed and flags & os.O_CREAT:
                    ino = rec._new_ino(st)
                    rec._names[entry[0]][entry[1]] = ino
                    rec._add(Op("create", ino=ino, dst=entry))
                elif flags & os.O_TRUNC and stat.S_ISREG(st.st_mode):
                    ino = rec._real_ino.get((st.st_dev, st.st_ino), -1)
                    if ino >= 0:
                        rec._add(Op("trunc", ino=ino, size=0))
                return fd

        def w_write(fd: int, data: Any) -> int:
            with rec._lock:
                ino = rec._fd_ino(fd)
                pos = os.lseek(fd, 0, os.SEEK_CUR) if ino is not None else 0
                done = real["write"](fd, data)
                if ino is not None and done > 0:
                    rec._add(Op("write", ino=ino, offset=pos, data=bytes(memoryview(data).cast("B")[:done])))
                return int(done)

        def w_pwrite(fd: int, data: Any, offset: int) -> int:
            with rec._lock:
                done = real["pwrite"](fd, data, offset)
                ino = rec._fd_ino(fd)
                if ino is not None and done > 0:
                    rec._add(Op("write", ino=ino, offset=offset, data=bytes(memoryview(data).cast("B")[:done])))
                return int(done)

        def w_pwritev(fd: int, buffers: Any, offset: int, *flags: int) -> int:
            with rec._lock:
                bufs = [bytes(memoryview(b).cast("B")) for b in buffers]
                done = real["pwritev"](fd, buffers, offset, *flags)
                ino = rec._fd_ino(fd)
                if ino is not None and done > 0:
                    rec._add(Op("write", ino=ino, offset=offset, data=b"".join(bufs)[:done]))
                return int(done)

        def w_ftruncate(fd: int, length: int) -> None:
            with rec._lock:
                real["ftruncate"](fd, length)
                ino = rec._fd_ino(fd)
                if ino is not None:
                    rec._add(Op("trunc", ino=ino, size=length))

        def barrier(name: str) -> Callable[[int], None]:
            def w_sync(fd: int) -> None:
                with rec._lock:
                    start = len(rec.ops)
                    try:
                        st = os.fstat(fd)
                        ino = rec._real_ino.get((st.st_dev, st.st_ino))
                        is_dir = stat.S_ISDIR(st.st_mode)
                    except OSError:
                        ino, is_dir = None, False
                real[name](fd)  # outside the lock: other threads keep writing meanwhile
                if ino is not None:
                    with rec._lock:
                        rec._add(Op("dsync" if is_dir else "sync", ino=ino, covers=start))
            return w_sync

        def no_dir_fd(kw: dict[str, Any]) -> None:
            assert all(v is None for k, v in kw.items() if k.endswith("dir_fd")), \
                "a name relative to a dir_fd is not recorded"

        def w_rename(name: str) -> Callable[..., None]:
            def rename(src: Any, dst: Any, **kw: Any) -> None:
                no_dir_fd(kw)
                with rec._lock:
                    s, d = rec._entry(src), rec._entry(dst)
                    real[name](src, dst, **kw)
                    if s is None or d is None:
                        assert s is None and d is None, f"a rename across the recorded root: {src} -> {dst}"
                        return
                    ino = rec._names[s[0]].pop(s[1])
                    rec._names[d[0]][d[1]] = ino
                    rec._add(Op("rename", ino=ino, src=s, dst=d))
            return rename

        def w_unlink(name: str) -> Callable[..., None]:
            def unlink(path: Any, **kw: Any) -> None:
                no_dir_fd(kw)
                with rec._lock:
                    e = rec._entry(path)
                    real[name](path, **kw)
                    if e is not None:
                        ino = rec._names[e[0]].pop(e[1])
                        rec._add(Op("rmdir" if name == "rmdir" else "unlink", ino=ino, src=e))
            return unlink

        def w_link(src: Any, dst: Any, **kw: Any) -> None:
            no_dir_fd(kw)
            with rec._lock:
                s, d = rec._entry(src), rec._entry(dst)
                real["link"](src, dst, **kw)
                if d is not None:
                    assert s is not None, f"a link from outside the recorded root: {src}"
                    ino = rec._names[s[0]][s[1]]
                    rec._names[d[0]][d[1]] = ino
                    rec._add(Op("link", ino=ino, dst=d))

        def w_mkdir(path: Any, mode: int = 0o777, **kw: Any) -> None:
            no_dir_fd(kw)
            with rec._lock:
                e = rec._entry(path)
                real["mkdir"](path, mode, **kw)
                if e is not None:
                    ino = rec._new_ino(os.lstat(path))
                    rec._names[ino] = {}
                    rec._names[e[0]][e[1]] = ino
                    rec._add(Op("mkdir", ino=ino, dst=e))

        def w_copy(name: str) -> Callable[..., int]:
            def copy(src_fd: int, dst_fd: int, count: int, *args: Any) -> int:
                with rec._lock:
                    if name == "sendfile":  # sendfile(out, in, offset, count)
                        out_fd, in_fd, in_off, n = src_fd, dst_fd, count, args[0]
                        if in_off is None:  # from (and advancing) in's position
                            in_off = os.lseek(in_fd, 0, os.SEEK_CUR)
                        out_off = os.lseek(out_fd, 0, os.SEEK_CUR)
                        done = real[name](src_fd, dst_fd, count, *args)
                    else:  # copy_file_range(src, dst, count, offset_src, offset_dst)
                        in_fd, out_fd, n = src_fd, dst_fd, count
                        given = list(args) + [None] * (2 - len(args))
                        in_off = given[0] if given[0] is not None else os.lseek(in_fd, 0, os.SEEK_CUR)
                        out_off = given[1] if given[1] is not None else os.lseek(out_fd, 0, os.SEEK_CUR)
                        done = real[name](src_fd, dst_fd, count, *args)
                    ino = rec._fd_ino(out_fd)
                    if ino is not None and done > 0:
                        rec._add(Op("write", ino=ino, offset=out_off, data=os.pread(in_fd, done, in_off)))
                    del n
                    return int(done)
            return copy

        return {
            "open": w_open, "write": w_write, "pwrite": w_pwrite, "pwritev": w_pwritev,
            "ftruncate": w_ftruncate, "fsync": barrier("fsync"), "fdatasync": barrier("fdatasync"),
            "replace": w_rename("replace"), "rename": w_rename("rename"), "unlink": w_unlink("unlink"),
            "remove": w_unlink("remove"), "rmdir": w_unlink("rmdir"), "link": w_link, "mkdir": w_mkdir,
            "copy_file_range": w_copy("copy_file_range"), "sendfile": w_copy("sendfile"),
        }

    @contextmanager
    def active(self) -> Iterator[Recorder]:
        """Wrap the ``os`` calls for the duration (process-wide: helper threads are seen too)."""
        real = {name: getattr(os, name) for name in self._PATCHED}
        wrapped = self._wrap(real)
        for name, fn in wrapped.items():
            setattr(os, name, fn)
        defaults = open_regular.__kwdefaults__  # ``opener=os.open`` was bound at import
        open_regular.__kwdefaults__ = {**(defaults or {}), "opener": wrapped["open"]}
        try:
            yield self
        finally:
            open_regular.__kwdefaults__ = defaults
            for name, fn in real.items():
                setattr(os, name, fn)
            self._order_concurrent_barriers()

    def _order_concurrent_barriers(self) -> None:
        """Barriers that ran at the same time (each started before the other was recorded:
        the kv file's and the sidecar's fdatasync of one commit) are put in one fixed order
        (the newer inode first), so the record does not depend on which finished first. No
        state is lost: a crash between them leaves a subset of the states a crash before both
        leaves."""
        ops = self.ops
        changed = True
        while changed:
            changed = False
            for i in range(len(ops) - 1):
                a, b = ops[i], ops[i + 1]
                if (a.kind in ("sync", "dsync") and b.kind in ("sync", "dsync") and b.covers <= i
                        and b.ino > a.ino):
                    ops[i], ops[i + 1] = b, a
                    changed = True

    def sync_filesystem(self, sync: Callable[[], None]) -> None:
        """Run ``sync()``, a barrier of the whole file system (``syncfs``), and record it as what it
        makes durable: every file and directory under the root (what was recorded before it started)."""
        with self._lock:
            start = len(self.ops)
            inos = sorted(set(self._real_ino.values()))
        sync()
        with self._lock:
            for ino in inos:
                self._add(Op("dsync" if ino in self._names else "sync", ino=ino, covers=start))

    def mark(self, label: str, value: int = 0) -> None:
        """Note a protocol point (e.g. ``mark("ack", n)`` once a commit of n records returned)."""
        with self._lock:
            self._add(Op("mark", label=label, value=value))

    # -- soundness of the record ------------------------------------------------------------------
    def check_replay(self, build: Callable[[Snapshot, list[Op]], dict[str, bytes | None]]) -> None:
        """The tree ``build`` replays from the snapshot and every op (all kept) must equal the
        real tree under the root: a write that went around the recorder fails here."""
        replayed = build(self.snapshot, self.ops)
        real: dict[str, bytes | None] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            for d in dirnames:
                real[os.path.normpath(os.path.join(rel, d))] = None
            for f in filenames:
                if unmodelled(f):
                    continue
                with open(os.path.join(dirpath, f), "rb") as fh:
                    real[os.path.normpath(os.path.join(rel, f))] = fh.read()
        missing = sorted(set(real) ^ set(replayed))
        assert not missing, f"names the recorder did not see: {missing}"
        differ = sorted(p for p in real if real[p] != replayed[p])
        assert not differ, f"files whose bytes the recorder did not see written: {differ}"


__all__ = ["DATA_KINDS", "NAME_KINDS", "Entry", "Op", "Recorder", "Snapshot", "unmodelled"]
