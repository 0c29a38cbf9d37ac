"""A stateful machine (hypothesis): append / commit / truncate / close / crash / reopen, checked
against a model after every step. A crash is injected at a random step of the next commit or
truncate (optionally with a power cut), then the file is reopened: it must hold the model's
committed records or, if the crash came after the commit word, the new ones.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sessionstore.kvfile import Buffer, Durability
from sessionstore.kvfile.durability import SharedDurability
from sessionstore.kvfile.layout import pack_records
from sessionstore.kvfile.writer import KVWriter
from sessionstore.testing import FaultyDurability, SimulatedCrash
from tests.support.writer import (
    DIMS,
    assert_sidecar_sound,
    gen_fp8,
    leftovers,
    read_committed,
    record_size,
)

REC = record_size(2, DIMS)
T = TypeVar("T")


class SwitchedDurability(Durability):
    """The writer's durability, passed in when it is opened: every step goes to ``inner``, which
    the machine swaps for a crashing one to crash a live writer (a fault seam it owns)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner: Durability = SharedDurability()

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return self.inner.open(path, flags, mode)

    def pwrite(self, fd: int, data: Buffer, offset: int) -> None:
        self.inner.pwrite(fd, data, offset)

    def pwritev(self, fd: int, buffers: Sequence[Buffer], offset: int) -> None:
        self.inner.pwritev(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        self.inner.fsync(fd)

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        self.inner.start_writeback(fd, offset, length)

    def begin(self, fn: Callable[..., T], *args: object) -> Callable[[], T]:
        return self.inner.begin(fn, *args)

    def fsync_begin(self, fd: int) -> Callable[[], None]:
        return self.inner.fsync_begin(fd)

    def fsync_all(self, fds: Sequence[int]) -> None:
        self.inner.fsync_all(fds)

    def replace(self, src: str, dst: str) -> None:
        self.inner.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        self.inner.fsync_dir(path)

    def unlink(self, path: str) -> None:
        self.inner.unlink(path)

    def release(self) -> None:
        self.inner.release()


def record_bytes(position: int, epoch: int) -> bytes:
    return pack_records(2, DIMS, gen_fp8(DIMS, position, 1, epoch)).tobytes()


class WriterMachine(RuleBasedStateMachine):
    @initialize(staging=st.sampled_from([1, 2, 5, 64]), write_behind=st.booleans())
    def start(self, staging: int, write_behind: bool) -> None:
        self.dir = tempfile.mkdtemp(prefix="coli-stateful-")
        self.path = os.path.join(self.dir, "kv")
        self.staging = staging
        self.write_behind = write_behind
        self.epoch = 0
        self.committed: list[int] = []  # epoch of each committed record
        self.staged: list[int] = []  # epoch of each appended, uncommitted record
        self.io = SwitchedDurability()
        self.writer: KVWriter | None = KVWriter.open(self.path, DIMS, staging_bytes=staging * REC,
                                                     write_behind=write_behind, durability=self.io)

    def teardown(self) -> None:
        if getattr(self, "writer", None) is not None:
            self.writer.close(commit=False)
        if getattr(self, "dir", None):
            shutil.rmtree(self.dir, ignore_errors=True)

    @precondition(lambda self: self.writer is not None)
    @rule(k=st.integers(1, 9))
    def append(self, k: int) -> None:
        start = len(self.committed) + len(self.staged)
        self.epoch += 1
        self.writer.append(gen_fp8(DIMS, start, k, self.epoch))
        self.staged += [self.epoch] * k

    @precondition(lambda self: self.writer is not None)
    @rule()
    def commit(self) -> None:
        assert self.writer.commit() == len(self.committed) + len(self.staged)
        self.committed += self.staged
        self.staged = []

    @precondition(lambda self: self.writer is not None)
    @rule(n=st.integers(-2, 60))
    def truncate(self, n: int) -> None:
        everything = self.committed + self.staged
        n = max(0, min(n, len(everything)))
        assert self.writer.truncate(n) == n
        self.committed, self.staged = everything[:min(n, len(self.committed))], \
            everything[len(self.committed):n]

    @precondition(lambda self: self.writer is not None)
    @rule(commit=st.booleans())
    def close(self, commit: bool) -> None:
        self.writer.close(commit=commit)
        if commit:
            self.committed += self.staged
        self.staged = []
        self.writer = None

    @precondition(lambda self: self.writer is not None)
    @rule(k=st.integers(0, 12), power_cut=st.booleans(), seed=st.integers(0, 3),
          truncate_to=st.none() | st.integers(0, 40))
    def crash(self, k: int, power_cut: bool, seed: int, truncate_to: int | None) -> None:
        """Swap in a faulty durability object and crash at step k of a commit (or truncate)."""
        io = FaultyDurability(k, mode="crash", lose_unsynced=power_cut, seed=seed)
        before = list(self.committed)
        everything = self.committed + self.staged
        self.io.inner = io
        if truncate_to is None:
            after = everything
        else:
            n = min(truncate_to, len(everything))
            after = everything[:min(n, len(self.committed))]
        try:
            if truncate_to is None:
                self.writer.commit()
            else:
                self.writer.truncate(n)
        except SimulatedCrash:
            pass
        self.writer.close(commit=False)
        self.writer = None
        _, nrec, body, _ = read_committed(self.path)
        for option in (before, after):
            if nrec == len(option) and body == b"".join(record_bytes(p, e) for p, e in enumerate(option)):
                self.committed = option
                break
        else:
            raise AssertionError(f"after a crash: nrec {nrec} matches neither committed state")
        self.staged = []

    @precondition(lambda self: self.writer is None)
    @rule()
    def reopen(self) -> None:
        self.io = SwitchedDurability()
        self.writer = KVWriter.open(self.path, DIMS, staging_bytes=self.staging * REC,
                                    write_behind=self.write_behind, durability=self.io)
        assert self.writer.nrec == len(self.committed) and self.writer.length == self.writer.nrec

    @invariant()
    def disk_holds_the_committed_records(self) -> None:
        if not hasattr(self, "path"):
            return
        _, nrec, body, _ = read_committed(self.path)
        assert nrec == len(self.committed)
        assert body == b"".join(record_bytes(p, e) for p, e in enumerate(self.committed))
        if self.writer is not None:
            assert (self.writer.nrec, self.writer.length) == \
                (len(self.committed), len(self.committed) + len(self.staged))
        if self.writer is None:
            assert_sidecar_sound(self.path, require=False)
            assert leftovers(self.dir) == []


TestWriterMachine = WriterMachine.TestCase
TestWriterMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
