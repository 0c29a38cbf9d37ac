"""REAL crashes: a forked child appends / upgrades / converts, the parent SIGKILLs it at a random
moment, then checks the files. 300 kills in all (append 200, upgrade 50, convert 50).

After every kill: the file opens; it holds exactly a prefix of what was appended (bytes compared
with the deterministic generator); never fewer records than the last acknowledged commit; the
sidecar vouches only for matching records. Upgrade: the whole v1 or the whole v2. Convert: SRC
untouched, DST absent or complete.
"""
from __future__ import annotations

import os
import random
import select
import shutil
import signal
import struct
import time

import pytest

from sessionstore.kvfile.convert import convert_file
from sessionstore.kvfile.header import Dims, Header, pack_header
from sessionstore.kvfile.layout import pack_records
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import sidecar_path
from sessionstore.kvfile.writer import KVWriter
from tests.support.writer import (
    DIMS,
    assert_sidecar_sound,
    expected_records,
    gen_f32,
    gen_fp8,
    leftovers,
    read_committed,
    record_size,
)

ACK = struct.Struct("<ii")  # (kind, value)
COMMITTED, TRUNCATING, UPGRADED, CONVERTED, COMMITTING = 0, 1, 2, 3, 4
APPEND_KILLS, UPGRADE_KILLS, CONVERT_KILLS = 200, 50, 50
MAX_RECORDS = 3000
BIG = Dims(n_layers=4, kv_lora=64, qk_rope=16, index_head_dim=0, n_index_layers=0, vocab=1000)
BIG_N = 1200  # v1 records in the upgrade / convert source (~1.5 MB)


def _fork(body) -> tuple[int, int]:
    """Run ``body(ack)`` in a forked child; returns (pid, read end of its ack pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 0
        try:
            os.close(r)
            body(lambda kind, value: os.write(w, ACK.pack(kind, value)))
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _kill_after(pid: int, r: int, delay: float, after_acks: int = 0) -> list[tuple[int, int]]:
    """Wait for ``after_acks`` acks (load-independent), sleep ``delay``, SIGKILL, reap; returns
    every ack the child managed to send. Asserts the child was killed, not ended on its own."""
    data = b""
    deadline = time.monotonic() + 10.0
    while len(data) < after_acks * ACK.size and time.monotonic() < deadline:
        if select.select([r], [], [], 0.1)[0]:
            chunk = os.read(r, ACK.size)
            if not chunk:
                break
            data += chunk
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
        f"child ended on its own (status {status}): it failed before the kill"
    return [ACK.unpack_from(data, i) for i in range(0, len(data) - len(data) % ACK.size, ACK.size)]


# -- 1. append + commit + truncate loop ------------------------------------------------------------
def _append_child(path: str, seed: int):
    def body(ack):
        rng = random.Random(seed)
        w = KVWriter.open(path, DIMS, staging_bytes=rng.choice([1, 3, 16]) * record_size(2, DIMS),
                          write_behind=rng.random() < 0.5, preallocate=rng.choice([0, None]))
        ack(COMMITTED, w.nrec)
        while True:
            if w.nrec and (rng.random() < 0.08 or w.length > MAX_RECORDS - 40):
                n = rng.randrange(0, w.nrec)
                ack(TRUNCATING, n)  # before: a kill right after the durable truncate is allowed
                w.truncate(n)
            w.append(gen_fp8(DIMS, w.length, rng.randint(1, 24)))
            ack(COMMITTING, w.length)
            ack(COMMITTED, w.commit())
    return body


@pytest.mark.slow
def test_sigkill_during_append_commit_truncate(tmp_path):
    path = str(tmp_path / "kv")
    expected = expected_records(2, DIMS, MAX_RECORDS)
    rec = record_size(2, DIMS)
    rng = random.Random(1234)
    floor, in_commit, acked_kills = 0, 0, 0
    for i in range(APPEND_KILLS):
        pid, r = _fork(_append_child(path, seed=i))
        acks = _kill_after(pid, r, rng.uniform(0.0, 0.003), after_acks=rng.choice([0, 1, 1, 2, 4, 8]))
        ceiling = floor
        for kind, value in acks:
            if kind == COMMITTED:
                floor = ceiling = value
            elif kind == TRUNCATING:
                floor = min(floor, value)
            elif kind == COMMITTING:
                ceiling = value
        acked_kills += bool(acks)
        in_commit += bool(acks) and acks[-1][0] == COMMITTING
        _, nrec, body, _ = read_committed(path) if os.path.exists(path) else (b"", 0, b"", 0)
        assert floor <= nrec <= ceiling, \
            f"kill {i}: {nrec} records; acknowledged {floor}, appended at most {ceiling}"
        assert body == expected[:nrec * rec], f"kill {i}: committed records are not the prefix"
        if os.path.exists(path):
            with open_kv(path, expect=DIMS) as reader:
                assert reader.nrec == nrec
            assert_sidecar_sound(path, require=False)  # absent only if killed while creating
        floor = nrec
    # the kills landed everywhere: before the first ack, between commits, inside commits
    assert acked_kills >= APPEND_KILLS // 4 and in_commit >= APPEND_KILLS // 20, \
        (acked_kills, in_commit)
    assert leftovers(tmp_path) == []


# -- 2. v1 -> v2 upgrade ---------------------------------------------------------------------------
def _big_v1(path: str) -> None:
    with KVWriter.open(path, BIG, kv_dtype="f32") as w:
        w.append(gen_f32(BIG, 0, BIG_N))


UPGRADE_TAIL = 500


def _upgrade_child(path: str):
    def body(ack):
        w = KVWriter.open(path, BIG, kv_dtype="fp8", upgrade_chunk_bytes=64 << 10)
        w.upgrade()
        ack(UPGRADED, w.nrec)
        for _ in range(UPGRADE_TAIL):  # the parent's expected tail holds this many records
            w.append(gen_fp8(BIG, w.length, 1))
            ack(COMMITTED, w.commit())
        time.sleep(3600)  # wait for the kill
    return body


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


@pytest.mark.slow
def test_sigkill_during_upgrade_leaves_whole_v1_or_whole_v2(tmp_path):
    template = str(tmp_path / "template")
    _big_v1(template)
    original = open(template, "rb").read()
    v2 = pack_header(Header(2, BIG, BIG_N)) + pack_records(2, BIG, gen_f32(BIG, 0, BIG_N)).tobytes()
    tail = pack_records(2, BIG, gen_fp8(BIG, BIG_N, UPGRADE_TAIL)).tobytes()
    rec2 = record_size(2, BIG)
    work = tmp_path / "work"
    work.mkdir()
    path = str(work / "kv")

    def fresh() -> None:
        for name in os.listdir(work):
            os.unlink(work / name)
        shutil.copyfile(template, path)
        shutil.copyfile(sidecar_path(template), sidecar_path(path))

    fresh()

    def one_upgrade() -> None:
        with KVWriter.open(path, BIG, kv_dtype="fp8", upgrade_chunk_bytes=64 << 10) as w:
            w.upgrade()
    span = _timed(one_upgrade)
    rng = random.Random(99)
    outcomes = {"v1": 0, "v2": 0, "temp": 0}
    for i in range(UPGRADE_KILLS):
        fresh()
        pid, r = _fork(_upgrade_child(path))
        # the last kill lands once the upgrade acknowledged (a loaded machine can slow every child past
        # 1.6 spans): whole v2 is always among the outcomes
        acks = _kill_after(pid, r, rng.uniform(0.0, 1.6 * span), after_acks=int(i == UPGRADE_KILLS - 1))
        data = open(path, "rb").read()
        outcomes["temp"] += bool(leftovers(work))
        if data == original:
            assert not acks, f"kill {i}: upgrade acknowledged but the file is still v1"
            outcomes["v1"] += 1
        else:
            _, nrec, body, _ = read_committed(path)
            assert data[:40 + BIG_N * rec2] == v2[:32] + data[32:36] + v2[36:40 + BIG_N * rec2], \
                f"kill {i}: neither the whole v1 nor the whole v2"
            floor = max([v for k, v in acks if k == COMMITTED] + [BIG_N])
            assert floor <= nrec <= BIG_N + UPGRADE_TAIL
            assert body[BIG_N * rec2:] == tail[:(nrec - BIG_N) * rec2]
            outcomes["v2"] += 1
        assert_sidecar_sound(path, require=False)
        with KVWriter.open(path, BIG, kv_dtype="fp8"):  # recovery removes the stale temps
            pass
        assert leftovers(work) == []
    assert outcomes["v1"] and outcomes["v2"] and outcomes["temp"], outcomes


@pytest.mark.parametrize("state, dies_at", [("absent", "write"), ("absent", "fsync"),
                                             ("damaged", "replace")])
def test_kill_inside_sidecar_creation_leaves_nothing_behind(tmp_path, state, dies_at):
    """Deterministic: the child dies (SIGKILL) at the first ``os.<dies_at>`` while the writer
    creates or replaces the sidecar; the next writer open repairs it and no temp file remains."""
    path = str(tmp_path / "kv")
    _big_v1(path)
    if state == "absent":
        os.unlink(sidecar_path(path))
    else:
        with open(sidecar_path(path), "r+b") as f:
            f.write(b"garbage!")  # bad magic: a damaged sidecar

    def body(ack):
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        setattr(os, dies_at, die)  # the child only
        KVWriter.open(path, BIG, kv_dtype="f32")
    pid, r = _fork(body)
    _, status = os.waitpid(pid, 0)
    os.close(r)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "never reached"
    side = sidecar_path(path)
    left_behind = {"write": os.path.getsize(side) == 0,  # created, header never written
                   "fsync": os.path.getsize(side) == 64,  # header written, not yet durable
                   "replace": os.path.exists(side + ".tmp")}[dies_at]  # the temp of a replace
    assert left_behind, os.listdir(tmp_path)
    with KVWriter.open(path, BIG, kv_dtype="f32") as w:
        assert w.nrec == BIG_N
    assert_sidecar_sound(path)
    assert leftovers(tmp_path) == []


# -- 3. convert v1 -> v2 (sessionstore.kvfile.convert) ----------------------------------------------------
def _convert_child(src: str, dst: str):
    def body(ack):
        convert_file(src, dst, 2, chunk_bytes=64 << 10)
        ack(CONVERTED, 1)
        time.sleep(60)  # done: wait for the kill
    return body


@pytest.mark.slow
def test_sigkill_during_convert_leaves_src_untouched_and_dst_absent_or_complete(tmp_path):
    src = str(tmp_path / "src")
    _big_v1(src)
    src_bytes, src_stamp = open(src, "rb").read(), os.stat(src).st_mtime_ns
    out = tmp_path / "out"
    out.mkdir()
    reference = str(tmp_path / "reference")
    span = _timed(lambda: convert_file(src, reference, 2, chunk_bytes=64 << 10))
    complete = open(reference, "rb").read()
    dst = str(out / "dst")
    rng = random.Random(7)
    outcomes = {"absent": 0, "complete": 0, "temp": 0}
    for i in range(CONVERT_KILLS):
        for name in os.listdir(out):
            os.unlink(out / name)
        pid, r = _fork(_convert_child(src, dst))
        # the last kill lands once the convert acknowledged: a complete DST is always among the outcomes
        acks = _kill_after(pid, r, rng.uniform(0.0, 3.0 * span), after_acks=int(i == CONVERT_KILLS - 1))
        assert open(src, "rb").read() == src_bytes and os.stat(src).st_mtime_ns == src_stamp
        outcomes["temp"] += bool(leftovers(out))
        if os.path.exists(dst):
            assert open(dst, "rb").read() == complete, f"kill {i}: DST exists but is not complete"
            assert_sidecar_sound(dst, require=False)
            outcomes["complete"] += 1
        else:
            assert not acks, f"kill {i}: convert acknowledged but DST is absent"
            outcomes["absent"] += 1
    assert outcomes["absent"] and outcomes["complete"] and outcomes["temp"], outcomes
    if os.path.exists(dst):
        os.unlink(dst)
    with open(dst + ".tmp", "wb") as f:  # a stale temp of a killed run: the next run replaces it
        f.write(b"half")
    convert_file(src, dst, 2, chunk_bytes=64 << 10)
    assert open(dst, "rb").read() == complete and leftovers(out) == []
