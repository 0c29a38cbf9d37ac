"""v1 -> v2 / v3 upgrade of a file opened with fp8 or the 4-bit tier on: untouched until the first
append, then one atomic switch from the whole v1 to the whole new file (faults injected at every
step). Every test runs for each target: fp8 (v2), int4 and polar4 (v3)."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from kernels.fp8 import quantize_rows
from kernels.rows import KV_FORMAT_OF_DTYPE
from kernels.tq import TqCodec
from sessionstore.kvfile.durability import Durability
from sessionstore.kvfile.header import Header, pack_header
from sessionstore.kvfile.layout import pack_records
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import load_sidecar, sidecar_path
from sessionstore.kvfile.upgrade import UPGRADE_SUFFIX
from sessionstore.kvfile.writer import KVWriter
from sessionstore.testing import FaultyDurability, SimulatedCrash
from tests.support.writer import (
    DIMS,
    DIMS_IX,
    assert_sidecar_sound,
    gen_f32,
    leftovers,
    read_committed,
    record_size,
    scenario_steps,
)

N = 9
REC1 = record_size(1, DIMS)


def _v1_file(path: str, n: int = N, dims=DIMS) -> bytes:
    with KVWriter.open(path, dims, kv_dtype="f32") as w:
        w.append(gen_f32(dims, 0, n))
    with open(path, "rb") as f:
        return f.read()


TARGETS = ("fp8", "int4", "polar4")


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest) -> str:
    """The kv dtype the v1 file is opened with: its upgrade goes to v2 (fp8) or v3 (4-bit)."""
    return str(request.param)


def _v2_bytes(n: int, dims=DIMS, target: str = "fp8") -> bytes:
    """What the upgrade must produce for n records of gen_f32 (v2 via the row quantizer, v3 via
    the codec of ``target``)."""
    version, tag = KV_FORMAT_OF_DTYPE[target]
    return (pack_header(Header(version, dims, n, tag))
            + pack_records(version, dims, gen_f32(dims, 0, n), tag).tobytes())


def test_v1_opened_for_fp8_is_untouched_until_first_append(tmp_path, target):
    path = str(tmp_path / "kv")
    original = _v1_file(path)
    stamp = os.stat(path).st_mtime_ns
    side_before = open(sidecar_path(path), "rb").read()
    with KVWriter.open(path, DIMS, kv_dtype=target) as w:
        assert w.pending_upgrade and w.version == 1 and w.nrec == N
        w.commit()  # nothing appended: nothing to do
    with KVWriter.open(path, DIMS, kv_dtype=target):
        pass
    assert open(path, "rb").read() == original and os.stat(path).st_mtime_ns == stamp
    assert open(sidecar_path(path), "rb").read() == side_before
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("dims", [DIMS, DIMS_IX], ids=["plain", "indexer"])
@pytest.mark.parametrize("chunk_records", [1, 4, 1000])
def test_first_append_upgrades_to_exact_v2(tmp_path, dims, chunk_records, target):
    path = str(tmp_path / "kv")
    _v1_file(path, dims=dims)
    with open_kv(path) as old_reader:  # a reader mapping the v1 keeps seeing the v1
        old_lc = np.array(old_reader.records["layers"]["lc"])  # [N, L, kv_lora] f32
        with KVWriter.open(path, dims, kv_dtype=target,
                           upgrade_chunk_bytes=chunk_records * record_size(1, dims)) as w:
            w.append(gen_f32(dims, N, 2))
            assert (w.version, w.nrec, w.length, w.pending_upgrade) == (
                KV_FORMAT_OF_DTYPE[target][0], N, N + 2, False)
        assert np.array_equal(old_reader.records["layers"]["lc"], old_lc)
    expected = _v2_bytes(N + 2, dims, target)
    assert open(path, "rb").read() == expected
    with open_kv(path) as r:  # the codes are the engine's row quantizer / v3 codec of the f32 rows
        lc = gen_f32(dims, 0, N + 2).lc
        codes, scales = quantize_rows(lc) if target == "fp8" else TqCodec.from_kv_dtype(target).encode_rows(lc)
        assert np.array_equal(r.records["layers"]["lc"], codes)
        assert np.array_equal(r.records["layers"]["lc_scale"], scales)
    assert load_sidecar(path).count == N + 2
    assert_sidecar_sound(path)
    assert leftovers(tmp_path) == []


def test_explicit_upgrade_keeps_mode_and_only_complete_committed_records(tmp_path, target):
    path = str(tmp_path / "kv")
    original = _v1_file(path)
    with open(path, "r+b") as f:  # stale tail: half a record of junk past the commit
        f.seek(0, 2)
        f.write(b"\xff" * (REC1 // 2))
    os.chmod(path, 0o600)
    with KVWriter.open(path, DIMS, kv_dtype=target) as w:
        assert w.upgrade() is True
        assert w.upgrade() is False
    assert open(path, "rb").read() == _v2_bytes(N, target=target)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert len(original) == 40 + N * REC1


def test_truncate_while_pending_upgrades_only_the_kept_records(tmp_path, target):
    path = str(tmp_path / "kv")
    _v1_file(path)
    with KVWriter.open(path, DIMS, kv_dtype=target) as w:
        assert w.truncate(4) == 4
        assert w.version == KV_FORMAT_OF_DTYPE[target][0] and w.nrec == 4
    assert open(path, "rb").read() == _v2_bytes(4, target=target)
    assert_sidecar_sound(path)


def test_f32_writer_never_upgrades(tmp_path):
    path = str(tmp_path / "kv")
    _v1_file(path, n=3)
    with KVWriter.open(path, DIMS, kv_dtype="f32") as w:
        w.append(gen_f32(DIMS, 3, 2))
    _, nrec, body, _ = read_committed(path)
    assert nrec == 5 and body == pack_records(1, DIMS, gen_f32(DIMS, 0, 5)).tobytes()


def test_stale_temp_files_are_removed_at_open(tmp_path, target):
    path = str(tmp_path / "kv")
    original = _v1_file(path)
    for junk in (path + UPGRADE_SUFFIX, path + UPGRADE_SUFFIX + ".colisum",
                 path + UPGRADE_SUFFIX + ".colisum.tmp", path + ".create.tmp"):
        with open(junk, "wb") as f:
            f.write(b"half-written")
    with KVWriter.open(path, DIMS, kv_dtype=target) as w:
        assert w.pending_upgrade
    assert leftovers(tmp_path) == []
    assert open(path, "rb").read() == original


# -- fault injection at every step of: open(fp8) ; append (upgrade) ; commit ; close ------------
V1_STATE = None  # filled per test: the original v1 bytes


def _scenario(path: str, io: Durability | None, acks: list[int], retry: bool = False,
              held: list[KVWriter] | None = None, target: str = "fp8") -> None:
    def call(fn, *args):
        try:
            return fn(*args)
        except OSError as exc:
            if not retry or exc.errno != errno.EIO:
                raise
            return fn(*args)

    w = call(lambda: KVWriter.open(path, DIMS, kv_dtype=target, durability=io,
                                   upgrade_chunk_bytes=3 * REC1))
    if held is not None:
        held.append(w)
    acks.append(0)
    call(w.append, gen_f32(DIMS, N, 2))
    acks.append(1)
    call(w.commit)
    acks.append(2)
    w.close()


STEPS = scenario_steps(_v1_file, _scenario)


def test_upgrade_scenario_has_the_switch_steps(target):
    steps = scenario_steps(_v1_file, lambda path, io, acks: _scenario(path, io, acks, target=target))
    assert {"open", "pwrite", "fsync", "unlink", "replace", "fsync_dir"} <= set(steps)
    assert steps == STEPS  # the same protocol whatever the target encoding


def _check(path: str, original: bytes, last_ack: int, target: str = "fp8") -> str:
    data = open(path, "rb").read()
    states = {"v1": original, "v2": _v2_bytes(N, target=target), "v2+2": _v2_bytes(N + 2, target=target)}
    allowed = [["v1", "v2"], ["v2", "v2+2"], ["v2+2"]][last_ack]
    if data[:8] != b"COLIKV1\0" and data != states["v2+2"]:
        # the new file with nrec N: the appended records may sit past the commit word (a stale tail)
        version, tag = KV_FORMAT_OF_DTYPE[target]
        _, nrec, body, _ = read_committed(path)
        data = data[:40 + nrec * Header(version, DIMS, 0, tag).record_bytes]
    name = next((s for s in allowed if data == states[s]), None)
    assert name is not None, f"file is none of {allowed} (last ack {last_ack})"
    assert_sidecar_sound(path, require=False)
    with KVWriter.open(path, DIMS, kv_dtype=target) as w:  # reopen: temps gone, still works
        assert w.nrec == {"v1": N, "v2": N, "v2+2": N + 2}[name]
    assert leftovers(os.path.dirname(path)) == []
    return name


@pytest.mark.parametrize("k", range(len(STEPS)))
@pytest.mark.parametrize("power_cut_seed", [None, 3], ids=["crash", "powercut"])
def test_crash_at_every_upgrade_step_leaves_whole_v1_or_whole_v2(tmp_path, k, power_cut_seed, target):
    path = str(tmp_path / "kv")
    original = _v1_file(path)
    io = FaultyDurability(k, mode="crash", lose_unsynced=power_cut_seed is not None,
                          seed=power_cut_seed or 0)
    acks: list[int] = []
    held: list[KVWriter] = []
    with pytest.raises(SimulatedCrash):
        try:
            _scenario(path, io, acks, held=held, target=target)
        finally:
            for w in held:
                w.close(commit=False)
    _check(path, original, acks[-1] if acks else 0, target)


def test_crashes_hit_both_sides_of_the_switch(tmp_path, target):
    seen = set()
    for k in range(len(STEPS)):
        path = str(tmp_path / f"kv{k}")
        original = _v1_file(path)
        held: list[KVWriter] = []
        with pytest.raises(SimulatedCrash):
            try:
                _scenario(path, FaultyDurability(k, mode="crash"), [], held=held, target=target)
            finally:
                for w in held:
                    w.close(commit=False)
        seen.add(_check(path, original, 0 if k <= STEPS.index("replace") else 1, target))
    assert seen == {"v1", "v2", "v2+2"}


@pytest.mark.parametrize("k", range(len(STEPS)))
def test_error_at_every_upgrade_step_is_retried(tmp_path, k, target):
    path = str(tmp_path / "kv")
    _v1_file(path)
    io = FaultyDurability(k, mode="error")
    acks: list[int] = []
    _scenario(path, io, acks, retry=True, target=target)
    assert acks == [0, 1, 2]
    assert open(path, "rb").read() == _v2_bytes(N + 2, target=target)
    assert_sidecar_sound(path)
    assert leftovers(tmp_path) == []
