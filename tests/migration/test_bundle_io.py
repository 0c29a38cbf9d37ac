"""The bundle's plain-file I/O: the write-through sink with streamed write-back, exact reads."""
from __future__ import annotations

import io
import os

import pytest

from sessionstore.kvfile import Durability
from sessionstore.migration import bundle_io
from sessionstore.migration.bundle_io import WritebackFile, read_exactly_into


class _Steps(Durability):
    """The sink's write-back and fdatasync steps, passed in: each call goes to the test's function."""

    def __init__(self, *, start_writeback=None, fsync=None) -> None:
        super().__init__()
        self._kick, self._sync = start_writeback, fsync

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        self._kick(fd, offset, length) if self._kick else super().start_writeback(fd, offset, length)

    def fsync(self, fd: int) -> None:
        self._sync(fd) if self._sync else super().fsync(fd)


def test_writeback_file_writes_everything_and_starts_write_back_per_window(tmp_path, monkeypatch):
    kicks = []
    monkeypatch.setattr(bundle_io, "WRITEBACK_BYTES", 1000)
    steps = _Steps(start_writeback=lambda fd, offset, length: kicks.append((offset, length)))
    data = os.urandom(3500)
    with WritebackFile.create(tmp_path / "f", io=steps) as out:
        for i in range(0, len(data), 300):
            assert out.write(memoryview(data)[i:i + 300]) == len(data[i:i + 300])
        out.flush()
        out.sync()
        assert out.offset == 3500
    assert (tmp_path / "f").read_bytes() == data
    assert kicks == [(0, 1200), (1200, 1200), (2400, 1100)]  # contiguous, each >= the window


def test_writeback_file_continues_short_writes(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(bundle_io.os, "write", lambda fd, view: real_write(fd, view[:7]))
    with WritebackFile.create(tmp_path / "f") as out:
        out.write(b"0123456789" * 5)
    assert (tmp_path / "f").read_bytes() == b"0123456789" * 5


def test_writeback_file_never_replaces_or_follows(tmp_path):
    (tmp_path / "exists").write_bytes(b"precious")
    with pytest.raises(FileExistsError):
        WritebackFile.create(tmp_path / "exists")
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    with pytest.raises(OSError):
        WritebackFile.create(tmp_path / "link")
    assert not (tmp_path / "elsewhere").exists()
    assert (tmp_path / "exists").read_bytes() == b"precious"


class _Trickle(io.RawIOBase):
    """A source that returns at most 3 bytes per call, with or without readinto."""

    def __init__(self, data: bytes, readinto: bool) -> None:
        self._data, self._pos = data, 0
        if not readinto:
            self.readinto = None  # type: ignore[assignment]

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        piece = self._data[self._pos:self._pos + min(n, 3)]
        self._pos += len(piece)
        return piece

    def readinto(self, buf) -> int:  # type: ignore[override]
        piece = self.read(len(buf))
        buf[:len(piece)] = piece
        return len(piece)


@pytest.mark.parametrize("has_readinto", [True, False])
def test_read_exactly_into_fills_across_short_reads_and_stops_at_the_end(has_readinto):
    buf = memoryview(bytearray(10))
    src = _Trickle(b"abcdefghijklm", has_readinto)
    assert read_exactly_into(src, buf) == 10 and bytes(buf) == b"abcdefghij"
    assert read_exactly_into(src, buf) == 3 and bytes(buf[:3]) == b"klm"  # the stream ended


def test_writeback_file_syncs_ahead_in_the_background_one_at_a_time(tmp_path, monkeypatch):
    import threading

    calls: list[tuple[int, str]] = []
    gate = threading.Event()

    def fsync(fd: int) -> None:
        calls.append((fd, threading.current_thread().name))
        if len(calls) == 1:
            gate.wait(5)  # the first background sync is still running while more bytes arrive

    data = os.urandom(5000)
    with WritebackFile.create(tmp_path / "f", sync_ahead=1000, io=_Steps(fsync=fsync)) as out:
        for i in range(0, 3000, 500):
            out.write(data[i:i + 500])
        assert [name for _, name in calls] == ["coli-sync-ahead"]  # one at a time: no second yet
        gate.set()
        out.settle()
        for i in range(3000, 5000, 500):
            out.write(data[i:i + 500])
        out.sync()
        fd = out.fileno()
    names = [name for _, name in calls]
    assert names[0] == names[1] == "coli-sync-ahead" and names[-1] == threading.current_thread().name
    assert all(f == fd for f, _ in calls)
    assert (tmp_path / "f").read_bytes() == data


def test_writeback_file_raises_a_failed_background_sync(tmp_path, monkeypatch):
    def fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    with WritebackFile.create(tmp_path / "f", sync_ahead=100, io=_Steps(fsync=fsync)) as out:
        out.write(b"x" * 150)  # starts the background sync, which fails
        with pytest.raises(OSError, match="Input/output"):
            out.settle()
        out.settle()  # reported once
        out.write(b"y" * 150)
        with pytest.raises(OSError, match="Input/output"):
            out.sync()


def test_import_fails_when_a_background_sync_failed(tmp_path, monkeypatch):
    """A received file's background fdatasync fails (only that one: the disk answers every other
    barrier): the import fails with it and the store gets no session."""
    import threading

    from sessionstore.migration import export_session, migrate
    from sessionstore.sessions import SessionStore
    from tests.support.migrate import make_session

    a, b = SessionStore(tmp_path / "A"), SessionStore(tmp_path / "B")
    make_session(a, "chat", 37, kv_dtype="fp8")
    sink = io.BytesIO()
    export_session(a, "chat", sink)
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        if threading.current_thread().name == "coli-sync-ahead":
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(migrate, "SYNC_AHEAD_BYTES", 100)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    with pytest.raises(OSError, match="Input/output"):
        migrate.import_bundle(b, io.BytesIO(sink.getvalue()))
    assert not b.exists("chat")
