"""One barrier for several sessions' tail commits (issue 39): :func:`commit_together` writes every
commit's page, makes them durable with ONE ``syncfs`` of their file system, then settles each, in
order; a failed write fails its commit alone, a failed barrier fails them all; a session whose
barrier is a seam of its own (a test's faults) is never shared."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from sessionstore.kvfile import Durability
from sessionstore.sessions import committer as committer_module
from sessionstore.sessions.committer import BarrierCommit, Committer, commit_together

pytestmark = pytest.mark.skipif(not committer_module.syncfs_available(), reason="no syncfs(2) on this system")


class Trace:
    """The order of every write, barrier and settle of a test's commits."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[str] = []
        real = committer_module.syncfs

        def counted(fd: int) -> None:
            self.events.append("barrier")
            real(fd)

        monkeypatch.setattr(committer_module, "syncfs", counted)

    def commit(self, path: Path, name: str, *, fail_write: bool = False) -> BarrierCommit:
        fd = os.open(path / name, os.O_RDWR | os.O_CREAT, 0o644)
        settled: list[BaseException | None] = []

        def write() -> int:
            if fail_write:
                raise OSError(28, "no space left")
            os.pwrite(fd, name.encode(), 0)
            self.events.append(f"write {name}")
            return fd

        def settle(error: BaseException | None) -> int:
            self.events.append(f"settle {name}" + ("" if error is None else f" {type(error).__name__}"))
            settled.append(error)
            if error is not None:
                raise error
            return 1

        return BarrierCommit(write, os.fdatasync, settle, os.fstat(fd).st_dev)


def test_one_barrier_covers_every_page_and_each_settles_after_it_in_order(tmp_path, monkeypatch) -> None:
    trace = Trace(monkeypatch)
    commits = [trace.commit(tmp_path, f"s{i}") for i in range(4)]
    assert commit_together(commits) == [None] * 4
    assert trace.events == [*(f"write s{i}" for i in range(4)), "barrier", *(f"settle s{i}" for i in range(4))]
    assert all((tmp_path / f"s{i}").read_bytes() == f"s{i}".encode() for i in range(4))


def test_a_failed_write_fails_its_commit_alone(tmp_path, monkeypatch) -> None:
    trace = Trace(monkeypatch)
    commits = [trace.commit(tmp_path, "a"), trace.commit(tmp_path, "b", fail_write=True), trace.commit(tmp_path, "c")]
    errors = commit_together(commits)
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], OSError) and errors[1].errno == 28
    assert trace.events == ["write a", "write c", "barrier", "settle a", "settle b OSError", "settle c"]


def test_a_failed_barrier_fails_every_commit_and_releases_nothing(tmp_path, monkeypatch) -> None:
    trace = Trace(monkeypatch)

    def eio(fd: int) -> None:
        trace.events.append("barrier")
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(committer_module, "syncfs", eio)
    errors = commit_together([trace.commit(tmp_path, "a"), trace.commit(tmp_path, "b")])
    assert [e.errno if isinstance(e, OSError) else e for e in errors] == [5, 5]
    assert trace.events == ["write a", "write b", "barrier", "settle a OSError", "settle b OSError"]


def test_commits_on_different_barriers_are_refused(tmp_path, monkeypatch) -> None:
    trace = Trace(monkeypatch)
    a, b = trace.commit(tmp_path, "a"), trace.commit(tmp_path, "b")
    b.share = ("another", b.share)
    with pytest.raises(ValueError, match="do not share"):
        commit_together([a, b])
    a.share = None
    with pytest.raises(ValueError, match="do not share"):
        commit_together([a, a])
    assert trace.events == []


def test_a_commit_called_alone_syncs_its_own_file(tmp_path, monkeypatch) -> None:
    trace = Trace(monkeypatch)
    synced: list[int] = []
    commit = trace.commit(tmp_path, "a")
    commit.sync = synced.append
    after: list[str] = []
    assert commit.then(lambda: after.append("cleared"))() == 1
    assert trace.events == ["write a", "settle a"] and len(synced) == 1 and after == ["cleared"]


def test_only_the_real_barrier_is_shared(tmp_path) -> None:
    (tmp_path / "m").write_text("{}")
    real = Committer("s", tmp_path / "m", tmp_path / "kv", Durability().fsync)
    assert real.share_key() == os.stat(tmp_path).st_dev
    assert Committer("s", tmp_path / "m", tmp_path / "kv", os.fdatasync).share_key() == os.stat(tmp_path).st_dev

    class Faulty(Durability):
        def fsync(self, fd: int) -> None:
            raise OSError(5, "injected")

    assert Committer("s", tmp_path / "m", tmp_path / "kv", Faulty().fsync).share_key() is None
    assert Committer("s", tmp_path / "m", tmp_path / "kv", lambda fd: None).share_key() is None
