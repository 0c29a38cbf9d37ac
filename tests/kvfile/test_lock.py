"""One writer at a time: flock on ``<path>.lock``; readers never blocked; released on death."""
from __future__ import annotations

import os
import signal
import time

import pytest

from kernels.errors import FormatError, LockedError
from sessionstore.kvfile.lock import WriterLock, lock_path
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.writer import KVWriter
from tests.support.writer import DIMS, gen_fp8


@pytest.fixture
def kv(tmp_path):
    path = str(tmp_path / ".coli_kv")
    with KVWriter.open(path, DIMS) as w:
        w.append(gen_fp8(DIMS, 0, 3))
    return path


def _hold_lock_in_child(path: str, *, open_writer: bool) -> tuple[int, int]:
    """Fork a child that takes the lock, reports on a pipe, then sleeps. Returns (pid, read fd)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(r)
            held = [KVWriter.open(path, DIMS) if open_writer else WriterLock(path).acquire()]
            os.write(w, b"locked")
            time.sleep(30)  # holding ``held`` until killed
            held.clear()
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 16) == b"locked"
    return pid, r


def test_second_writer_in_same_process_refused_at_once(kv):
    with KVWriter.open(kv, DIMS) as first:
        started = time.perf_counter()
        with pytest.raises(LockedError) as info:
            KVWriter.open(kv, DIMS)
        assert time.perf_counter() - started < 1.0  # non-blocking
        assert kv in str(info.value) and f"pid {os.getpid()}" in str(info.value)
        with open_kv(kv) as reader:  # readers are not blocked
            assert reader.nrec == 3
        first.append(gen_fp8(DIMS, 3, 1))
    with KVWriter.open(kv, DIMS) as again:  # released on close
        assert again.nrec == 4


def test_second_writer_in_another_process_refused_and_lock_dies_with_it(kv):
    pid, r = _hold_lock_in_child(kv, open_writer=True)
    try:
        with pytest.raises(LockedError, match=f"pid {pid}"):
            KVWriter.open(kv, DIMS)
        with open_kv(kv) as reader:
            assert reader.nrec == 3
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
    with KVWriter.open(kv, DIMS) as w:  # SIGKILL released the flock
        assert w.nrec == 3


def test_lock_released_when_holder_exits(kv):
    pid, r = _hold_lock_in_child(kv, open_writer=False)
    with pytest.raises(LockedError):
        WriterLock(kv).acquire()
    os.kill(pid, signal.SIGTERM)
    os.waitpid(pid, 0)
    os.close(r)
    with WriterLock(kv) as lock:
        assert lock.held
    assert not lock.held


def test_lock_is_beside_the_file_never_on_it(kv):
    before = os.stat(kv)
    with WriterLock(kv) as lock:
        assert lock.lock_path == lock_path(kv) == kv + ".lock"
        assert os.path.isfile(kv + ".lock")
        with open(kv + ".lock") as f:
            assert f.read().strip() == str(os.getpid())
    after = os.stat(kv)
    assert (before.st_mtime_ns, before.st_size) == (after.st_mtime_ns, after.st_size)


def test_symlinked_lock_file_refused(tmp_path):
    path = str(tmp_path / "kv")
    os.symlink(tmp_path / "elsewhere", path + ".lock")
    with pytest.raises(FormatError, match="symlink"):
        WriterLock(path).acquire()


def test_the_pid_is_rewritten_in_place_eleven_bytes(kv):
    """The next holder overwrites the pid in place (no truncate: on ext4 a truncate and rewrite
    costs milliseconds at the close); a shorter earlier pid leaves nothing behind, a longer foreign
    content is cut first."""
    path = kv + ".lock"
    with open(path, "w") as f:
        f.write("7\n")
    ino = os.stat(path).st_ino
    with WriterLock(kv):
        with open(path, "rb") as f:
            data = f.read()
        assert len(data) == 11 and data.endswith(b"\n") and data.decode().strip() == str(os.getpid())
    assert os.stat(path).st_ino == ino
    with open(path, "w") as f:
        f.write("x" * 40 + "\n")
    with WriterLock(kv):
        with open(path) as f:
            assert f.read().strip() == str(os.getpid()) and os.path.getsize(path) == 11
