"""Zero-filled headroom (``KVWriter.open(preallocate=...)``): small commits overwrite allocated
blocks; the headroom is a stale tail that readers, ``inspect`` and ``verify`` report and never
count; crashes (injected at every step, with power cuts, and real SIGKILLs) reopen to a
committed prefix; a failed refill only turns preallocation off.
"""
from __future__ import annotations

import json
import os
import random

import pytest

from sessionstore.kvfile.header import Dims
from sessionstore.kvfile.headroom import PREALLOC_RECORDS, default_headroom
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import load_sidecar, sidecar_path
from sessionstore.kvfile.verify import verify_file
from sessionstore.kvfile.writer import KVWriter
from sessionstore.testing import FaultyDurability, SimulatedCrash, count_steps
from tests.kvfile.test_crash_sigkill import COMMITTED, COMMITTING, _fork, _kill_after
from tests.support.writer import (
    DIMS,
    assert_sidecar_sound,
    expected_records,
    gen_fp8,
    leftovers,
    read_committed,
    record_size,
)

REC = record_size(2, DIMS)  # 44 B: the headroom is page-aligned, so it is counted in pages
HEADROOM = 200 * REC  # refilled when less than half is left: every ~100 one-record commits
WIDE = Dims(n_layers=4, kv_lora=256, qk_rope=32, index_head_dim=0, n_index_layers=0, vocab=1000)
WREC = record_size(2, WIDE)  # 1188 B: a refill every few commits in the crash scenarios
WIDE_HEADROOM = 10 * WREC


def _tail(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    return data[40 + read_committed(path)[1] * REC:]


def test_default_writer_writes_exact_files(tmp_path):
    path = str(tmp_path / "kv")
    with KVWriter.open(path, DIMS) as w:
        for i in range(5):
            w.append(gen_fp8(DIMS, i, 1))
            w.commit()
    assert os.path.getsize(path) == 40 + 5 * REC
    assert os.path.getsize(sidecar_path(path)) == 64 + 8 * 5


def test_small_commits_leave_zero_headroom_reported_as_stale(tmp_path, capsys):
    path = str(tmp_path / "kv")
    with KVWriter.open(path, DIMS, preallocate=None) as w:
        for i in range(5):
            w.append(gen_fp8(DIMS, i, 1))
            w.commit()
    size = os.path.getsize(path)
    assert default_headroom(REC) == PREALLOC_RECORDS * REC
    assert size >= 40 + 5 * REC + default_headroom(REC) // 2 and size % 4096 == 0
    assert _tail(path) == bytes(size - 40 - 5 * REC)  # zeros, past nrec
    _, nrec, body, _ = read_committed(path)
    assert nrec == 5 and body == expected_records(2, DIMS, 5)
    with open_kv(path) as r:
        assert r.nrec == 5 and r.stale_tail_bytes == size - 40 - 5 * REC and r.warnings == []
    side = load_sidecar(path)
    assert side.count == 5 and side.available == 5  # zero entries past the count are not read
    assert os.path.getsize(sidecar_path(path)) > 64 + 8 * 5
    assert_sidecar_sound(path)
    report = verify_file(path)
    assert report.sound and report.stale_tail_bytes == size - 40 - 5 * REC
    from tools.coli_kv import main

    assert main(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["nrec"] == 5 and info["stale_tail_bytes"] == size - 40 - 5 * REC


def test_commits_inside_the_headroom_do_not_grow_the_file(tmp_path):
    path = str(tmp_path / "kv")
    sizes = []
    with KVWriter.open(path, DIMS, preallocate=HEADROOM) as w:
        for i in range(400):
            w.append(gen_fp8(DIMS, i, 1))
            w.commit()
            sizes.append(os.path.getsize(path))
            assert sizes[-1] - (40 + w.nrec * REC) >= HEADROOM // 2  # always headroom ahead
    grows = sum(b > a for a, b in zip(sizes, sizes[1:], strict=False))
    assert 2 <= grows <= 400 * REC // (HEADROOM // 2) + 1  # refills, not one growth per commit
    assert read_committed(path)[2] == expected_records(2, DIMS, 400)
    assert _tail(path) == bytes(len(_tail(path)))


def test_big_commits_get_no_headroom(tmp_path):
    path = str(tmp_path / "kv")
    with KVWriter.open(path, DIMS, preallocate=HEADROOM) as w:
        w.append(gen_fp8(DIMS, 0, 26))  # 26 records > 1/8 of the headroom: streaming
        w.commit()
    assert os.path.getsize(path) == 40 + 26 * REC


def test_truncate_then_append_overwrites_inside_the_headroom(tmp_path):
    path = str(tmp_path / "kv")
    with KVWriter.open(path, DIMS, preallocate=HEADROOM) as w:
        for i in range(6):
            w.append(gen_fp8(DIMS, i, 1))
            w.commit()
        size = os.path.getsize(path)
        assert size > 40 + 6 * REC
        w.truncate(3)
        w.append(gen_fp8(DIMS, 3, 1, epoch=1))
        w.commit()
    assert os.path.getsize(path) == size  # never shortened, nothing grown
    _, nrec, body, _ = read_committed(path)
    assert nrec == 4 and body == expected_records(2, DIMS, 3) + expected_records(2, DIMS, 4, epoch=1)[3 * REC:]
    assert_sidecar_sound(path)


def test_a_failed_refill_turns_preallocation_off_and_the_commit_stands(tmp_path):
    path = str(tmp_path / "kv")
    KVWriter.open(path, DIMS).close()  # created: the header's write is behind us
    # the first commit's writes: records (0), commit word (1), the headroom's zeros (2)
    io = FaultyDurability(2, mode="error", only={"pwrite"})
    with KVWriter.open(path, DIMS, durability=io, preallocate=HEADROOM) as w:
        w.append(gen_fp8(DIMS, 0, 1))
        assert w.commit() == 1  # the commit point was behind us: the error is only logged
        assert io.failed_step == "pwrite"
        for i in range(1, 4):
            w.append(gen_fp8(DIMS, i, 1))
            w.commit()
    assert os.path.getsize(path) == 40 + 4 * REC  # no headroom any more
    assert read_committed(path)[1:3] == (4, expected_records(2, DIMS, 4))
    assert_sidecar_sound(path)


# -- crashes -----------------------------------------------------------------------------------
def _scenario(path: str, io, acks: list[int], held: list[KVWriter], write_behind: bool = False) -> None:
    """One-record commits across refills, a truncate, more one-record commits (``write_behind``:
    each record written as it is appended, as a session's decode loop does)."""
    w = KVWriter.open(path, WIDE, durability=io, preallocate=WIDE_HEADROOM, write_behind=write_behind)
    held.append(w)
    for i in range(12):
        w.append(gen_fp8(WIDE, i, 1))
        acks.append(w.commit())
    w.truncate(9)
    acks.append(9)
    for i in range(9, 15):
        w.append(gen_fp8(WIDE, i, 1, epoch=1))
        acks.append(w.commit())
    w.close()


def _steps(write_behind: bool = False) -> list[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return count_steps(lambda io: _scenario(os.path.join(d, "kv"), io, [], [], write_behind))


STEPS = _steps()
STEPS_WB = _steps(write_behind=True)
CASES = [(False, k) for k in range(len(STEPS))] + [(True, k) for k in range(len(STEPS_WB))]
FINAL = expected_records(2, WIDE, 9) + expected_records(2, WIDE, 15, epoch=1)[9 * WREC:]


@pytest.mark.parametrize("write_behind, k", CASES)
@pytest.mark.parametrize("power_cut_seed", [None, 3], ids=["crash", "powercut"])
def test_crash_at_every_step_reopens_to_a_committed_prefix(tmp_path, write_behind, k, power_cut_seed):
    path = str(tmp_path / "kv")
    io = FaultyDurability(k, mode="crash", lose_unsynced=power_cut_seed is not None,
                          seed=power_cut_seed or 0)
    acks: list[int] = []
    held: list[KVWriter] = []
    with pytest.raises(SimulatedCrash):
        try:
            _scenario(path, io, acks, held, write_behind)
        finally:
            for w in held:
                w.close(commit=False)
    if not os.path.exists(path):
        assert not acks
        return
    _, nrec, body, _ = read_committed(path)
    last = acks[-1] if acks else 0
    # an acknowledged commit is never lost; a commit in flight may have landed; a truncate
    # in flight may have landed; the records are those of the epoch the file was in
    assert last <= nrec <= last + 1 or (last == 12 and nrec == 9), (k, acks, nrec)
    assert body in (expected_records(2, WIDE, nrec), FINAL[:nrec * WREC]), k
    with open_kv(path) as r:
        assert r.nrec == nrec
    with KVWriter.open(path, WIDE, preallocate=WIDE_HEADROOM) as w:  # recovery, then it works
        assert w.nrec == nrec
        w.append(gen_fp8(WIDE, nrec, 1, epoch=9))
    assert read_committed(path)[1] == nrec + 1
    assert_sidecar_sound(path)
    assert leftovers(tmp_path) == []


def test_the_scenario_refills_and_crosses_refills():
    commits = 12 + 6
    refills = STEPS.count("pwrite") - 2 * commits - 1  # records + commit word each; truncate: 1
    assert refills >= 3, STEPS


def _child(path: str, seed: int):
    def body(ack):
        rng = random.Random(seed)
        w = KVWriter.open(path, DIMS, preallocate=rng.choice([None, HEADROOM, 2 * HEADROOM]))
        ack(COMMITTED, w.nrec)
        while w.length < 2000:
            w.append(gen_fp8(DIMS, w.length, rng.randint(1, 2)))
            ack(COMMITTING, w.length)
            ack(COMMITTED, w.commit())
        while True:
            pass
    return body


SIGKILLS = 40


@pytest.mark.slow
def test_sigkill_during_small_commits_with_headroom(tmp_path):
    path = str(tmp_path / "kv")
    expected = expected_records(2, DIMS, 2100)
    rng = random.Random(77)
    floor, acked = 0, 0
    for i in range(SIGKILLS):
        pid, r = _fork(_child(path, seed=i))
        acks = _kill_after(pid, r, rng.uniform(0.0, 0.004), after_acks=rng.choice([1, 2, 8]))
        ceiling = floor
        for kind, value in acks:
            if kind == COMMITTED:
                floor = ceiling = value
            elif kind == COMMITTING:
                ceiling = value
        acked += bool(acks)
        _, nrec, body, _ = read_committed(path)
        assert floor <= nrec <= ceiling, (i, floor, nrec, ceiling)
        assert body == expected[:nrec * REC], f"kill {i}: committed records are not the prefix"
        with open_kv(path, expect=DIMS) as reader:
            assert reader.nrec == nrec
        assert_sidecar_sound(path)
        floor = nrec
    assert acked >= SIGKILLS // 2
    assert os.path.getsize(path) > 40 + floor * REC  # the headroom was really there
