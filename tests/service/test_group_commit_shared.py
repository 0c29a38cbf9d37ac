"""The tail commits of one pass that share a barrier run as ONE task in :class:`GroupCommit` (issue
39): one ``syncfs`` for them all, one thread, and still each owner gets its own commit's error (a
failed write fails its owner's commit alone); a commit that is not a shared BarrierCommit is its
own task."""
from __future__ import annotations

import os
import threading
from pathlib import Path

from sessionstore.service.steps.group_commit import GroupCommit
from sessionstore.sessions import committer as committer_module
from sessionstore.sessions.committer import BarrierCommit


def _commit(path: Path, name: str, seen: list[tuple[str, int]], *, fail: bool = False) -> BarrierCommit:
    fd = os.open(path / name, os.O_RDWR | os.O_CREAT, 0o644)

    def write() -> int:
        seen.append((f"write {name}", threading.get_ident()))
        if fail:
            raise OSError(28, "no space left")
        os.pwrite(fd, name.encode(), 0)
        return fd

    def settle(error: BaseException | None) -> int:
        seen.append((f"settle {name}", threading.get_ident()))
        os.close(fd)
        if error is not None:
            raise error
        return 1

    return BarrierCommit(write, os.fdatasync, settle, "one file system")


def test_shared_tail_commits_run_as_one_task_and_each_owner_gets_its_own_error(tmp_path, monkeypatch) -> None:
    barriers: list[int] = []
    monkeypatch.setattr(committer_module, "syncfs", lambda fd: barriers.append(fd))
    seen: list[tuple[str, int]] = []
    group, ran_alone = GroupCommit(4), threading.Event()
    try:
        for owner in ("a", "b", "c"):
            with group.collecting(owner):
                assert group.put_off(_commit(tmp_path, owner, seen, fail=owner == "a"), overlap=True)
        with group.collecting("d"):  # not a BarrierCommit: a task of its own
            assert group.put_off(ran_alone.set, overlap=True)
        group.start_all()
        errors = {owner: group.wait(owner) for owner in ("a", "b", "c", "d")}
    finally:
        group.close()
    assert errors["b"] is None and errors["c"] is None and errors["d"] is None
    assert isinstance(errors["a"], OSError) and errors["a"].errno == 28
    assert len(barriers) == 1  # one barrier for the pages written (b and c)
    assert [event for event, _ in seen] == ["write a", "write b", "write c", "settle a", "settle b", "settle c"]
    assert len({thread for _, thread in seen}) == 1 and threading.get_ident() not in {t for _, t in seen}
    assert ran_alone.is_set() and group.in_flight() == 0


def test_ready_leaves_a_running_shared_commit_and_collects_it_once_done(tmp_path, monkeypatch) -> None:
    gate = threading.Event()
    monkeypatch.setattr(committer_module, "syncfs", lambda fd: gate.wait(10))
    seen: list[tuple[str, int]] = []
    group = GroupCommit(2)
    try:
        for owner in ("a", "b"):
            with group.collecting(owner):
                group.put_off(_commit(tmp_path, owner, seen), overlap=True)
        group.start_all()
        assert group.ready("a") is None and group.in_flight() == 2  # still in its barrier: left running
        gate.set()
        assert group.wait("a") is None and group.wait("b") is None
        assert group.in_flight() == 0
    finally:
        gate.set()
        group.close()
