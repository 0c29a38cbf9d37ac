"""The crash states a POSIX file system may leave, built from a recorded protocol
(:mod:`tests.support.crash_trace`), and materialized into a directory for checking
(FORMAT.md 3.9; ALICE's and CrashMonkey's ideas, our code).

The model, at a crash after the first ``k`` recorded ops:

- File data: every write or truncate recorded before the start of the file's last completed
  fsync / fdatasync is durable. The ones after it are pending. The file is cut into blocks of
  ``sector`` bytes (512 or 4096); each block a pending op touched independently holds the bytes
  it had after ANY prefix of those ops (none: the durable bytes; all: the latest), as a page
  cache writing pages back in any order, at any time, leaves it: writes dropped, kept, torn at
  the block boundary, and reordered among themselves. The size is that after any prefix of the
  pending ops; a block past the durable size that holds no write reads as zeros.
- Names: a create, mkdir, link or rename is durable once the directory it names the file in
  was fsynced after it (the fsync started after it was recorded; a rename is atomic, so its
  source name goes with it), an unlink or rmdir once the directory it removes from was; before
  that each is independently kept or dropped, replayed in order on inodes: a kept rename puts
  its inode at the new name even when the create that named it first was dropped (the inode
  exists; only a name was lost). A file's own fsync never makes its name durable. With
  ``strict_rename`` a rename across two directories is durable only once both were fsynced.
- What was on disk when recording started is durable.

A state is one :class:`Choice` at a crash point (a value per independent "unit": a pending name,
a file's size, a touched block). :func:`states` enumerates every choice when there are at most
the budget, else the extreme ones (everything pending dropped, everything kept, one unit flipped
from each) and then random choices from a ``random.Random`` seeded by the caller,
deterministically, skipping states whose materialized bytes were already produced (the count
reported is of distinct states).
"""
from __future__ import annotations

import itertools
import os
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

import xxhash

from tests.support.crash_trace import DATA_KINDS, NAME_KINDS, Op, Snapshot

Tree = dict[str, bytes | None]  # relative path -> file bytes, or None for a directory


def _apply_data(content: bytearray, op: Op) -> None:
    if op.kind == "write":
        end = op.offset + len(op.data)
        if len(content) < end:
            content.extend(bytes(end - len(content)))
        content[op.offset:end] = op.data
    else:  # trunc
        if op.size < len(content):
            del content[op.size:]
        else:
            content.extend(bytes(op.size - len(content)))


def _blocks(op: Op, sector: int, size_before: int) -> range:
    """The blocks an op changes (a truncate: those it cuts or extends)."""
    if op.kind == "write":
        return range(op.offset // sector, (op.offset + len(op.data) + sector - 1) // sector)
    lo, hi = sorted((op.size, size_before))
    return range(lo // sector, (hi + sector - 1) // sector)


@dataclass
class FileAt:
    """One file at a crash point: its durable bytes, the pending ops' snapshots and sizes, and
    for each block the pending ops (indexes into ``snaps``) that touched it."""

    durable: bytes
    snaps: list[bytes]  # snaps[j]: the bytes after the first j pending ops (snaps[0] = durable)
    touched: dict[int, list[int]]  # block -> the j (1-based) of the pending ops touching it
    _by_sector: dict[int, list[tuple[int, int, list[bytes]]]] = field(default_factory=dict, repr=False)

    @cached_property
    def sizes(self) -> list[int]:
        """The j of each distinct size the file may have (the last j of each), by j."""
        last = {len(snap): j for j, snap in enumerate(self.snaps)}
        return sorted(last.values())

    @property
    def pending(self) -> int:
        """The number of size versions beyond the first (0: the size is known)."""
        return len(self.sizes) - 1

    def build(self, size_version: int, versions: dict[int, int], sector: int) -> bytes:
        """The file with the size ``sizes[size_version]`` and block b at version ``versions[b]``
        (an index into ``touched[b]``, 0 = durable)."""
        size = len(self.snaps[self.sizes[size_version]])
        parts: list[bytes] = []
        for lo, block, pieces in self._segments(sector):
            if lo >= size:
                break
            parts.append(pieces[0] if block < 0 else pieces[versions.get(block, len(pieces) - 1)])
        return b"".join(parts)[:size]

    def _segments(self, sector: int) -> list[tuple[int, int, list[bytes]]]:
        """The file cut at the touched blocks, for the largest size it may have: (offset, block, its
        versions' bytes, each a whole sector zero-padded, 0 = durable) per touched block, and
        (offset, -1, [the durable bytes, zero-padded]) per run of untouched blocks between them."""
        cached = self._by_sector.get(sector)
        if cached is not None:
            return cached
        end = -(-max(len(snap) for snap in self.snaps) // sector) * sector  # the largest size, whole sectors
        out: list[tuple[int, int, list[bytes]]] = []
        lo = 0
        for block in sorted(self.touched):
            start = block * sector
            if start >= end:
                break
            if lo < start:
                out.append((lo, -1, [_padded(self.durable, lo, start)]))
            ops = self.touched[block]
            out.append((start, block, [_padded(self.durable, start, start + sector)]
                        + [_padded(self.snaps[j], start, start + sector) for j in ops]))
            lo = start + sector
        if lo < end:
            out.append((lo, -1, [_padded(self.durable, lo, end)]))
        self._by_sector[sector] = out
        return out


def _distinct_versions(durable: bytes, snaps: list[bytes], touched: dict[int, list[int]],
                       sector: int) -> dict[int, list[int]]:
    """``touched`` without the blocks every version of which reads as the durable bytes (zeros
    written where zeros read anyway, the same bytes written again): they add no state."""
    out: dict[int, list[int]] = {}
    for block, versions in touched.items():
        lo, hi = block * sector, (block + 1) * sector
        before = _padded(durable, lo, hi)
        if any(_padded(snaps[j], lo, hi) != before for j in versions):
            out[block] = versions
    return out


def _padded(data: bytes, lo: int, hi: int) -> bytes:
    piece = data[lo:hi]
    return piece + bytes(hi - lo - len(piece))


@dataclass(frozen=True)
class Choice:
    """One crash state: which pending name ops are kept, and per file the size version and the
    block versions (missing blocks: the latest)."""

    names: tuple[bool, ...]
    sizes: tuple[tuple[int, int], ...]  # (inode, size version)
    blocks: tuple[tuple[int, int, int], ...]  # (inode, block, version)


class CrashPoint:
    """What may be on disk after a crash following the first ``k`` ops of a recording."""

    def __init__(self, snapshot: Snapshot, ops: list[Op], k: int, sector: int, *,
                 strict_rename: bool = False) -> None:
        """``strict_rename``: a rename across directories is durable only once both were fsynced."""
        self.snapshot = snapshot
        self.ops = ops[:k]
        self.sector = sector
        last_sync: dict[int, int] = {}  # file inode -> covers of its last completed barrier
        dsyncs: dict[int, list[int]] = {}  # directory inode -> covers of its barriers
        for op in self.ops:
            if op.kind == "sync":
                last_sync[op.ino] = max(last_sync.get(op.ino, 0), op.covers)
            elif op.kind == "dsync":
                dsyncs.setdefault(op.ino, []).append(op.covers)
        self.name_ops: list[tuple[Op, bool]] = []  # (op, durable)
        for i, op in enumerate(self.ops):
            if op.kind in NAME_KINDS:
                synced = all(any(c > i for c in dsyncs.get(d, [])) for d in op.dirs(both=strict_rename))
                self.name_ops.append((op, synced))
        self.pending_names = [i for i, (_, synced) in enumerate(self.name_ops) if not synced]
        self.files: dict[int, FileAt] = {}
        data: dict[int, list[tuple[int, Op]]] = {}
        for i, op in enumerate(self.ops):
            if op.kind in DATA_KINDS:
                data.setdefault(op.ino, []).append((i, op))
        inodes = set(snapshot.files) | set(data) | {op.ino for op in self.ops if op.kind == "create"}
        for ino in sorted(inodes):
            content = bytearray(snapshot.files.get(ino, b""))
            pending: list[Op] = []
            for i, op in data.get(ino, []):
                if i < last_sync.get(ino, 0):
                    _apply_data(content, op)
                else:
                    pending.append(op)
            durable = bytes(content)
            snaps = [durable]
            touched: dict[int, list[int]] = {}
            for j, op in enumerate(pending, 1):
                for b in _blocks(op, sector, len(content)):
                    touched.setdefault(b, []).append(j)
                _apply_data(content, op)
                snaps.append(bytes(content))
            self.files[ino] = FileAt(durable, snaps, _distinct_versions(durable, snaps, touched, sector))
        # the independent choices ("units") and how many values each takes
        self.radices: list[int] = [2] * len(self.pending_names)
        self._sized = [ino for ino, f in self.files.items() if f.pending]
        self.radices += [self.files[ino].pending + 1 for ino in self._sized]
        self._blocks = [(ino, b) for ino, f in self.files.items() for b in f.touched]
        self.radices += [len(self.files[ino].touched[b]) + 1 for ino, b in self._blocks]

    def units(self) -> int:
        """How many independent choices this crash point has (0: exactly one state)."""
        return len(self.radices)

    def space(self, limit: int) -> int:
        """The number of choices (capped at ``limit + 1``)."""
        total = 1
        for r in self.radices:
            total *= r
            if total > limit:
                return limit + 1
        return total

    # -- choices ---------------------------------------------------------------------------------
    def choice(self, values: tuple[int, ...]) -> Choice:
        """The choice a value per unit stands for (names: 1 = kept; sizes and blocks: how many of
        the pending ops touching them landed)."""
        n = len(self.pending_names)
        m = n + len(self._sized)
        return Choice(tuple(bool(v) for v in values[:n]),
                      tuple(zip(self._sized, values[n:m], strict=True)),
                      tuple((ino, b, v) for (ino, b), v in zip(self._blocks, values[m:], strict=True)))

    def extreme(self, keep: bool) -> Choice:
        """Everything pending kept (``keep``) or dropped."""
        return self.choice(tuple(r - 1 if keep else 0 for r in self.radices))

    def candidates(self, rng: random.Random, limit: int) -> Iterator[Choice]:
        """Every choice when there are at most ``limit``; else the two extremes, each with one
        unit flipped to its other extreme, then random choices (each unit uniform), endlessly."""
        if self.space(limit) <= limit:
            for values in itertools.product(*(range(r) for r in self.radices)):
                yield self.choice(values)
            return
        low = tuple(0 for _ in self.radices)
        high = tuple(r - 1 for r in self.radices)
        yield self.choice(low)
        yield self.choice(high)
        for base in (low, high):
            for i, r in enumerate(self.radices):
                flipped = list(base)
                flipped[i] = r - 1 - base[i]
                yield self.choice(tuple(flipped))
        draw = [(r, r.bit_length()) for r in self.radices]
        bits = rng.getrandbits
        while True:
            yield self.choice(tuple(_below(bits, r, k) for r, k in draw))

    # -- the tree a choice leaves ----------------------------------------------------------------
    def tree(self, choice: Choice) -> Tree:
        dirs = {d: dict(e) for d, e in self.snapshot.dirs.items()}
        for op, _ in self.name_ops:  # a directory exists once made, whatever names it has
            if op.kind == "mkdir":
                dirs.setdefault(op.ino, {})
        kept = iter(choice.names)
        for op, durable in self.name_ops:
            if not durable and not next(kept):
                continue
            _apply_name(dirs, op)
        sizes = dict(choice.sizes)
        versions: dict[int, dict[int, int]] = {}
        for ino, b, v in choice.blocks:
            versions.setdefault(ino, {})[b] = v
        out: Tree = {}
        stack = [(0, "")]
        while stack:
            d, prefix = stack.pop()
            for name, ino in dirs.get(d, {}).items():
                rel = f"{prefix}{name}"
                if ino in dirs:
                    out[rel] = None
                    stack.append((ino, rel + "/"))
                else:
                    f = self.files[ino]
                    out[rel] = f.build(sizes.get(ino, 0), versions.get(ino, {}), self.sector)
        return out


def _below(bits: Callable[[int], int], n: int, k: int) -> int:
    """``rng.randrange(n)`` (n >= 1, k = n.bit_length()) as CPython draws it, without its checks."""
    v = bits(k)
    while v >= n:
        v = bits(k)
    return v


def _apply_name(dirs: dict[int, dict[str, int]], op: Op) -> None:
    """Replay one name op; skipped when a dropped earlier op left it nothing to act on."""
    if op.kind in ("create", "mkdir", "link"):
        assert op.dst is not None
        if op.dst[0] not in dirs:
            return
        dirs[op.dst[0]][op.dst[1]] = op.ino
    elif op.kind in ("unlink", "rmdir"):
        assert op.src is not None
        entries = dirs.get(op.src[0], {})
        if entries.get(op.src[1]) == op.ino and not (op.kind == "rmdir" and dirs.get(op.ino)):
            del entries[op.src[1]]
    elif op.kind == "rename":  # the inode lands at dst even when the name it left never persisted
        assert op.src is not None and op.dst is not None
        entries = dirs.get(op.src[0], {})
        if entries.get(op.src[1]) == op.ino:
            del entries[op.src[1]]
        if op.dst[0] in dirs:
            dirs[op.dst[0]][op.dst[1]] = op.ino


def final_tree(snapshot: Snapshot, ops: list[Op]) -> Tree:
    """Every op kept: what the real tree must hold when recording ends (Recorder.check_replay)."""
    point = CrashPoint(snapshot, ops, len(ops), 4096)
    return point.tree(point.extreme(keep=True))


def tree_digest(tree: Tree) -> bytes:
    """A 128-bit digest of the names and bytes of a tree (xxh3: states are hashed by the ten
    thousand; a collision would only skip a state, never pass a wrong one)."""
    h = xxhash.xxh3_128()
    for path in sorted(tree):
        data = tree[path]
        h.update(path.encode() + (b"/D" if data is None else b"/F%d:" % len(data)))
        if data is not None:
            h.update(data)
    return h.digest()


def states(point: CrashPoint, rng: random.Random, budget: int, seen: set[bytes], *,
           salt: bytes = b"", tries: int = 4) -> Iterator[Tree]:
    """Distinct trees of this crash point whose key (``salt`` + the tree's digest) is not in
    ``seen`` (added as they are yielded), from :meth:`CrashPoint.candidates`: all of them when
    the point has at most ``budget`` choices, else until ``budget`` trees were yielded or
    ``tries * budget`` choices were drawn. The caller salts with what the check depends on
    besides the bytes (the committed bound)."""
    made = drawn = 0
    tried: set[Choice] = set()  # a choice drawn again leaves the tree it left before: its key is in seen already
    for choice in point.candidates(rng, budget):
        if made >= budget or drawn >= tries * budget:
            return
        drawn += 1
        if choice in tried:
            continue
        tried.add(choice)
        tree = point.tree(choice)
        key = salt + tree_digest(tree)
        if key in seen:
            continue
        seen.add(key)
        made += 1
        yield tree


def materialize(tree: Tree, directory: str) -> None:
    """Make ``directory`` hold exactly ``tree``: every file rewritten (a check may have changed
    any), names not in it removed."""
    os.makedirs(directory, exist_ok=True)
    _prune(directory, "", tree)
    parents = {""}  # the directories known to exist (relative; "" is ``directory``)
    for rel in sorted(tree):
        full = os.path.join(directory, rel)
        data = tree[rel]
        if data is None:
            os.makedirs(full, exist_ok=True)
            parents.add(rel)
            continue
        parent = os.path.dirname(rel)
        if parent not in parents:
            os.makedirs(os.path.join(directory, parent), exist_ok=True)
            parents.add(parent)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # as open(full, "wb")
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def _prune(path: str, rel: str, tree: Tree) -> None:
    """Remove under ``path`` (``rel`` in the tree's names) every file where ``tree`` holds no file
    and every directory where it holds no directory."""
    with os.scandir(path) as entries:
        found = list(entries)
    for entry in found:
        key = rel + entry.name
        if entry.is_dir(follow_symlinks=False):
            if key in tree and tree[key] is None:
                _prune(entry.path, key + "/", tree)
            else:
                shutil.rmtree(entry.path)
        elif tree.get(key) is None:  # a file (or a link) stays only where the tree has a file
            os.unlink(entry.path)


__all__ = ["Choice", "CrashPoint", "FileAt", "Tree", "final_tree", "materialize", "states",
           "tree_digest"]
