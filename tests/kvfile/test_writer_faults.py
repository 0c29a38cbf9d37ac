"""Fault injection through the replaceable durability step: fail or crash at EVERY step.

The scenario walks a file through four committed states; after an injected crash at step k
(optionally with a power cut that drops a random subset of the writes not yet fsynced) the
file must reopen to one of the two states around the last acknowledged one, byte for byte,
with a sound sidecar. After a transient error at step k, retrying the failed call must reach
the final state exactly.
"""
from __future__ import annotations

import errno
import os

import pytest

from sessionstore.kvfile.durability import Durability
from sessionstore.kvfile.header import Header, pack_header
from sessionstore.kvfile.writer import KVWriter
from sessionstore.testing import FaultyDurability, SimulatedCrash
from tests.support.writer import (
    DIMS,
    assert_sidecar_sound,
    expected_records,
    gen_fp8,
    leftovers,
    read_committed,
    record_size,
    scenario_steps,
)

REC = record_size(2, DIMS)
E0 = expected_records(2, DIMS, 16)
E1 = expected_records(2, DIMS, 16, epoch=1)
# The committed states the scenario passes through: (nrec, record bytes).
STATES = [(5, E0[:5 * REC]), (12, E0[:12 * REC]), (10, E0[:10 * REC]),
          (16, E0[:10 * REC] + E1[10 * REC:16 * REC])]


def _setup(path: str) -> None:
    with KVWriter.open(path, DIMS) as w:
        w.append(gen_fp8(DIMS, 0, 5))


def _scenario(path: str, io: Durability | None, acks: list[int], retry: bool = False,
              held: list[KVWriter] | None = None, write_behind: bool = False) -> None:
    """open; append 7 + commit; append 3 + truncate(10); append 6 (epoch 1) + commit; close.
    ``write_behind``: every append is written at once (more write steps, same states)."""
    def call(fn, *args):
        try:
            return fn(*args)
        except OSError as exc:
            if not retry or exc.errno != errno.EIO:
                raise
            return fn(*args)

    staging = 64 * REC if write_behind else 4 * REC  # big: nothing would be written early
    w = call(lambda: KVWriter.open(path, DIMS, durability=io, staging_bytes=staging,
                                   write_behind=write_behind))
    if held is not None:
        held.append(w)
    acks.append(0)
    w.append(gen_fp8(DIMS, 5, 7))
    before = w.nrec
    try:
        call(w.commit)
    finally:
        assert w.nrec in (before, 12)
    acks.append(1)
    w.append(gen_fp8(DIMS, 12, 3))
    call(w.truncate, 10)
    acks.append(2)
    call(w.append, gen_fp8(DIMS, 10, 6, epoch=1))
    call(w.commit)
    acks.append(3)
    w.close()


def _check_state(path: str, last_ack: int) -> int:
    """The file holds state ``last_ack`` or the next one, exactly; returns which."""
    static, nrec, body, _ = read_committed(path)
    assert static == pack_header(Header(2, DIMS))[:32] + pack_header(Header(2, DIMS))[36:]
    allowed = [i for i in (last_ack, last_ack + 1) if i < len(STATES)]
    for i in allowed:
        if (nrec, body) == STATES[i]:
            break
    else:
        raise AssertionError(f"nrec {nrec}: not one of the states {allowed} (last ack {last_ack})")
    assert_sidecar_sound(path)
    with KVWriter.open(path, DIMS) as w:  # recovery on open, then the file still works
        assert w.nrec == nrec
        w.append(gen_fp8(DIMS, nrec, 1, epoch=7))
    assert read_committed(path)[1] == nrec + 1
    assert_sidecar_sound(path)
    assert leftovers(os.path.dirname(path)) == []
    return i


def _scenario_write_behind(path: str, io: Durability | None, acks: list[int], retry: bool = False,
                           held: list[KVWriter] | None = None) -> None:
    _scenario(path, io, acks, retry, held, write_behind=True)


STEPS = scenario_steps(_setup, _scenario)
STEPS_WB = scenario_steps(_setup, _scenario_write_behind)
VARIANTS = {"staged": (_scenario, STEPS), "write_behind": (_scenario_write_behind, STEPS_WB)}
CASES = [(name, k) for name, (_, steps) in VARIANTS.items() for k in range(len(steps))]


def test_scenario_covers_every_kind_of_step():
    assert {"open", "pwrite", "fsync"} <= set(STEPS)
    assert len(STEPS) >= 12


@pytest.mark.parametrize("variant, k", CASES)
@pytest.mark.parametrize("power_cut_seed", [None, 1, 2], ids=["crash", "powercut1", "powercut2"])
def test_crash_at_every_step_leaves_a_committed_state(tmp_path, variant, k, power_cut_seed):
    scenario, steps = VARIANTS[variant]
    path = str(tmp_path / "kv")
    _setup(path)
    io = FaultyDurability(k, mode="crash", lose_unsynced=power_cut_seed is not None,
                          seed=power_cut_seed or 0)
    acks: list[int] = []
    with pytest.raises(SimulatedCrash):
        _scenario_abandoning(scenario, path, io, acks)
    assert io.failed_step == steps[k]
    _check_state(path, acks[-1] if acks else 0)


def _scenario_abandoning(scenario, path: str, io: FaultyDurability, acks: list[int]) -> None:
    """Run the scenario; on the crash drop the writer's descriptors as a dead process would."""
    held: list[KVWriter] = []
    try:
        scenario(path, io, acks, held=held)
    except SimulatedCrash:
        for w in held:
            w.close(commit=False)  # only closes descriptors and the lock: no I/O step runs
        raise


@pytest.mark.parametrize("variant, k", CASES)
def test_error_at_every_step_is_retried_to_the_final_state(tmp_path, variant, k):
    scenario, steps = VARIANTS[variant]
    path = str(tmp_path / "kv")
    _setup(path)
    io = FaultyDurability(k, mode="error")
    acks: list[int] = []
    scenario(path, io, acks, retry=True)
    assert io.failed_step == steps[k]
    assert acks == [0, 1, 2, 3]
    assert read_committed(path)[1:3] == STATES[-1]
    assert_sidecar_sound(path)
    assert leftovers(tmp_path) == []


def test_failed_commit_keeps_nrec_and_retries_the_whole_tail(tmp_path):
    path = str(tmp_path / "kv")
    _setup(path)
    fsyncs = FaultyDurability(0, mode="error", only={"fsync"})  # the first data fsync fails
    with KVWriter.open(path, DIMS, durability=fsyncs, staging_bytes=2 * REC) as w:
        w.append(gen_fp8(DIMS, 5, 7))
        with pytest.raises(OSError):
            w.commit()
        assert (w.nrec, w.length) == (5, 12)
        assert read_committed(path)[1] == 5  # the commit word did not move
        assert w.commit() == 12  # everything since nrec rewritten, fsynced, committed
    assert read_committed(path)[1:3] == STATES[1]
    assert_sidecar_sound(path)


def test_failed_nrec_fsync_then_truncate_never_resurrects_records(tmp_path):
    """The commit word may have landed before its fsync failed: a later truncate below it must
    rewrite the word before new records go over the old ones."""
    path = str(tmp_path / "kv")
    _setup(path)
    io = FaultyDurability(2, mode="error", only={"fsync"})  # data, sidecar, then THE nrec fsync
    w = KVWriter.open(path, DIMS, durability=io)
    w.append(gen_fp8(DIMS, 5, 7))
    with pytest.raises(OSError):
        w.commit()
    assert w.nrec == 5 and read_committed(path)[1] == 12  # on disk the word did land
    w.truncate(8)
    assert read_committed(path)[1] == 5  # rewritten to the committed count at once
    w.append(gen_fp8(DIMS, 8, 2, epoch=1))
    w.commit()
    w.close()
    _, nrec, body, _ = read_committed(path)
    assert nrec == 10 and body == E0[:8 * REC] + E1[8 * REC:10 * REC]
    assert_sidecar_sound(path)


def test_deferred_early_write_failure_is_reported_by_commit(tmp_path):
    path = str(tmp_path / "kv")
    _setup(path)
    io = FaultyDurability(0, mode="error", only={"pwrite"})  # the early write of a full chunk
    with KVWriter.open(path, DIMS, durability=io, staging_bytes=2 * REC) as w:
        w.append(gen_fp8(DIMS, 5, 7))  # the failure is logged and deferred, not raised
        assert w.commit() == 12
    assert read_committed(path)[1:3] == STATES[1]


def test_concurrent_fsync_raises_the_first_failure_after_both_finish():
    calls = []

    class HalfBroken(Durability):
        def fsync(self, fd: int) -> None:
            calls.append(fd)  # no real fsync: only the error plumbing is under test
            if fd == -7:
                raise OSError(errno.EIO, "sidecar fsync failed")

    io = HalfBroken()
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="sidecar"):
            io.fsync_all([fd, -7])
        assert sorted(calls) == [-7, fd]
        calls.clear()
        with pytest.raises(OSError, match="sidecar"):
            io.fsync_all([-7, fd])  # the failing one first: the other still runs
        assert sorted(calls) == [-7, fd]
    finally:
        io.release()
        os.close(fd)


def test_sidecar_fsync_failure_in_the_helper_thread_keeps_nrec(tmp_path):
    """The real concurrent path: the sidecar's fsync (helper thread) fails once."""
    path = str(tmp_path / "kv")
    _setup(path)
    from sessionstore.kvfile.sidecar import sidecar_path

    class SidecarFsyncFailsOnce(Durability):
        failed = False

        def fsync(self, fd: int) -> None:
            if not self.failed and os.path.realpath(f"/proc/self/fd/{fd}") == \
                    os.path.realpath(sidecar_path(path)):
                self.failed = True
                raise OSError(errno.EIO, "sidecar fsync failed")
            super().fsync(fd)

    io = SidecarFsyncFailsOnce()
    with KVWriter.open(path, DIMS, durability=io) as w:
        w.append(gen_fp8(DIMS, 5, 7))
        with pytest.raises(OSError, match="sidecar"):
            w.commit()
        assert io.failed and w.nrec == 5 and read_committed(path)[1] == 5
        assert w.commit() == 12
    assert read_committed(path)[1:3] == STATES[1]
    assert_sidecar_sound(path)
