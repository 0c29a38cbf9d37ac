"""KVWriter: append / commit / truncate / close, refusals, recovery on open, events."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from kernels.errors import FormatError, LimitError, LockedError, ModelMismatchError, NotFoundError
from kernels.fp8 import quantize_rows
from kernels.rows import RecordRows
from sessionstore import log as store_log
from sessionstore.kvfile.header import Dims, Header, pack_header
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import load_sidecar, record_checksum, sidecar_path
from sessionstore.kvfile.writer import KVWriter
from sessionstore.testing import FaultyDurability
from tests.support.writer import (
    DIMS,
    DIMS_IX,
    assert_sidecar_sound,
    expected_records,
    gen_f32,
    gen_fp8,
    read_committed,
    record_size,
)


@pytest.fixture
def kv(tmp_path):
    return str(tmp_path / ".coli_kv")


@pytest.mark.parametrize("dims", [DIMS, DIMS_IX], ids=["plain", "indexer"])
@pytest.mark.parametrize("staging_records", [1, 3, 1000])
@pytest.mark.parametrize("preallocate", [None, 0], ids=["headroom", "exact"])
def test_append_commit_bytes_v2(kv, dims, staging_records, preallocate):
    rec = record_size(2, dims)
    with KVWriter.open(kv, dims, staging_bytes=staging_records * rec, preallocate=preallocate) as w:
        assert (w.version, w.nrec, w.length) == (2, 0, 0)
        position = 0
        for k in (1, 2, 5, 1, 7, 4):  # small and big batches, across staging chunks
            w.append(gen_fp8(dims, position, k))
            position += k
            assert w.length == position and w.nrec < position
            if k == 5:
                assert w.commit() == position and w.nrec == position
        assert w.commit() == 20
    _, nrec, body, size = read_committed(kv)
    if preallocate == 0:
        assert nrec == 20 and size == 40 + 20 * rec
    else:  # small commits leave zero-filled headroom: a stale tail, never counted
        assert nrec == 20 and size > 40 + 20 * rec and size % 4096 == 0
        with open(kv, "rb") as f:
            assert f.read()[40 + 20 * rec:] == bytes(size - 40 - 20 * rec)
        with open_kv(kv) as r:
            assert r.nrec == 20 and r.stale_tail_bytes == size - 40 - 20 * rec
    assert body == expected_records(2, dims, 20)
    with open(kv, "rb") as f:
        assert f.read(40) == pack_header(Header(2, dims, 20))
    assert_sidecar_sound(kv)
    with open_kv(kv) as r:
        assert r.tokens.tolist() == list(range(11, 31))


def test_f32_rows_are_quantized_for_v2_and_kept_for_v1(tmp_path):
    rows = gen_f32(DIMS_IX, 0, 6)
    v2, v1 = str(tmp_path / "a"), str(tmp_path / "b")
    with KVWriter.open(v2, DIMS_IX, kv_dtype="fp8") as w:
        w.append(rows)
    with KVWriter.open(v1, DIMS_IX, kv_dtype="f32") as w:
        w.append(rows)
    codes, scales = quantize_rows(rows.lc)  # [6, L, 8] u8, [6, L] f32
    with open_kv(v2) as r:
        got = r.records["layers"]
        assert np.array_equal(got["lc"], codes) and np.array_equal(got["lc_scale"], scales)
        assert np.array_equal(r.index_rows(0), rows.index[:, 0])
    with open_kv(v1) as r:
        assert r.version == 1
        assert np.array_equal(r.records["layers"]["lc"], rows.lc)
        assert np.array_equal(r.records["layers"]["rc"], rows.rc)


def test_uncommitted_records_are_invisible_even_when_written_early(kv):
    rec = record_size(2, DIMS)
    with KVWriter.open(kv, DIMS, staging_bytes=2 * rec) as w:
        w.append(gen_fp8(DIMS, 0, 3))
        w.commit()
        w.append(gen_fp8(DIMS, 3, 9))  # fills staging chunks: written before the commit
        _, nrec, _, size = read_committed(kv)
        assert nrec == 3 and size > 40 + 3 * rec  # bytes are there, the commit word is not
        with open_kv(kv) as r:
            assert r.nrec == 3
        w.close(commit=False)
    _, nrec, body, _ = read_committed(kv)
    assert nrec == 3 and body == expected_records(2, DIMS, 3)


def test_write_behind_writes_each_append_at_once_and_commits_only_the_word(kv):
    """write_behind: every append lands past nrec at once (a stale tail until the commit);
    the commit then writes no record bytes, only the sidecar and the commit word."""
    rec = record_size(2, DIMS)
    io = FaultyDurability(None)
    with KVWriter.open(kv, DIMS, durability=io, staging_bytes=64 * rec, preallocate=None,
                       write_behind=True) as w:
        w.append(gen_fp8(DIMS, 0, 2))
        w.commit()
        for position in range(2, 6):
            w.append(gen_fp8(DIMS, position, 1))  # one record, far from filling a chunk
            with open(kv, "rb") as f:
                f.seek(40 + position * rec)
                assert f.read(rec) == expected_records(2, DIMS, position + 1)[position * rec:]
            assert read_committed(kv)[1] == 2  # not committed: a stale tail for readers
            with open_kv(kv) as r:
                assert r.nrec == 2
            assert load_sidecar(kv).count == 2  # its entry is written ahead, not vouched for
            with open(sidecar_path(kv), "rb") as f:
                f.seek(64 + 8 * position)
                record = expected_records(2, DIMS, position + 1)[position * rec:]
                assert f.read(8) == struct.pack("<Q", record_checksum(record, position))
        before = len(io.steps)
        w.truncate(5)  # drops a record that is already in the file: only the count forgets it
        assert w.commit() == 5
        assert io.steps[before:] == ["fsync", "fsync", "pwrite", "fsync"]  # sidecar, data, word
        w.append(gen_fp8(DIMS, 5, 1, epoch=1))
        w.close(commit=False)  # dropped: its bytes stay past nrec, never counted
    _, nrec, body, _ = read_committed(kv)
    assert nrec == 5 and body == expected_records(2, DIMS, 5)
    assert_sidecar_sound(kv)
    with KVWriter.open(kv, DIMS, write_behind=True) as w:  # recovery, then it goes on
        assert w.nrec == 5
        w.append(gen_fp8(DIMS, 5, 2, epoch=2))
    assert read_committed(kv)[2] == expected_records(2, DIMS, 5) + expected_records(
        2, DIMS, 7, epoch=2)[5 * rec:]
    assert_sidecar_sound(kv)


def test_context_manager_commits_on_success_only(kv):
    with KVWriter.open(kv, DIMS) as w:
        w.append(gen_fp8(DIMS, 0, 4))
    with pytest.raises(RuntimeError):
        with KVWriter.open(kv, DIMS) as w:
            w.append(gen_fp8(DIMS, 4, 4))
            raise RuntimeError("caller failed")
    assert read_committed(kv)[1] == 4
    with KVWriter.open(kv, DIMS) as w:  # the lock went with the failed writer
        assert w.nrec == 4 and w.length == 4


def test_truncate_semantics(kv):
    rec = record_size(2, DIMS)
    with KVWriter.open(kv, DIMS, staging_bytes=2 * rec) as w:
        w.append(gen_fp8(DIMS, 0, 10))
        w.commit()
        w.append(gen_fp8(DIMS, 10, 5))
        assert w.truncate(12) == 12 and w.nrec == 10  # drops staged records only
        assert read_committed(kv)[1] == 10
        assert w.truncate(99) == 12  # clamped to the appended length
        assert w.truncate(6) == 6 and w.nrec == 6  # below the commit: durable at once
        assert read_committed(kv)[1] == 6
        size_before = os.path.getsize(kv)
        w.append(gen_fp8(DIMS, 6, 3, epoch=1))  # overwrites the stale bytes
        w.commit()
        assert w.truncate(-5) == 0 and read_committed(kv)[1] == 0
        w.append(gen_fp8(DIMS, 0, 2, epoch=2))
    _, nrec, body, size = read_committed(kv)
    assert size == size_before  # the file is never shortened
    assert nrec == 2 and body == expected_records(2, DIMS, 2, epoch=2)
    assert_sidecar_sound(kv)


def test_truncate_after_partial_commits_and_reappend(kv):
    with KVWriter.open(kv, DIMS) as w:
        w.append(gen_fp8(DIMS, 0, 8))
        w.commit()
        w.truncate(5)
        w.append(gen_fp8(DIMS, 5, 4, epoch=1))
    _, nrec, body, _ = read_committed(kv)
    rec = record_size(2, DIMS)
    assert nrec == 9
    assert body[:5 * rec] == expected_records(2, DIMS, 5)
    assert body[5 * rec:] == expected_records(2, DIMS, 9, epoch=1)[5 * rec:]
    assert_sidecar_sound(kv)


def test_reopen_continues_after_nrec(kv):
    for start in range(0, 12, 4):
        with KVWriter.open(kv, DIMS, create=start == 0) as w:
            assert w.nrec == start
            w.append(gen_fp8(DIMS, start, 4))
    _, nrec, body, _ = read_committed(kv)
    assert nrec == 12 and body == expected_records(2, DIMS, 12)


def test_big_batch_then_small_appends_reuse_staging(kv):
    rec = record_size(2, DIMS)
    with KVWriter.open(kv, DIMS, staging_bytes=4 * rec) as w:
        w.append(gen_fp8(DIMS, 0, 300))
        for p in range(300, 310):
            w.append(gen_fp8(DIMS, p, 1))
            w.commit()
        w.append(gen_fp8(DIMS, 310, 2))
        w.truncate(311)
    _, nrec, body, _ = read_committed(kv)
    assert nrec == 311 and body == expected_records(2, DIMS, 311)


def test_refuses_other_dims_v2_for_f32_and_missing(tmp_path, kv):
    with KVWriter.open(kv, DIMS) as w:
        w.append(gen_fp8(DIMS, 0, 1))
    other = Dims(3, 8, 4, 0, 0, 1000)
    with pytest.raises(ModelMismatchError, match="differ"):
        KVWriter.open(kv, other)
    with pytest.raises(FormatError, match="fp8"):
        KVWriter.open(kv, DIMS, kv_dtype="f32")
    with pytest.raises(NotFoundError):
        KVWriter.open(str(tmp_path / "absent"), DIMS, create=False)
    with pytest.raises(NotFoundError):
        KVWriter.open(str(tmp_path / "no-dir" / "x"), DIMS)
    with pytest.raises(FormatError, match="kv_dtype"):
        KVWriter.open(kv, DIMS, kv_dtype="bf16")
    with KVWriter.open(kv, DIMS) as w:  # every refusal released the lock
        assert w.nrec == 1


def test_refuses_symlink_fifo_directory_device(tmp_path):
    target = tmp_path / "real"
    with KVWriter.open(str(target), DIMS):
        pass
    link = tmp_path / "link"
    link.symlink_to(target)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, word in ((link, "symlink"), (fifo, "FIFO"), (tmp_path, "directory"),
                       ("/dev/null", "device")):
        with pytest.raises(FormatError, match=word):
            KVWriter.open(str(path), DIMS)
    assert not os.path.exists("/dev/null.lock")
    assert sorted(os.listdir(tmp_path)) == ["fifo", "link", "real", "real.colisum", "real.lock"]


@pytest.mark.parametrize("content", [b"", b"COLIKV2\0" + b"\0" * 10, b"NOTAKV!!" + b"\0" * 40,
                                     b"COLIDV41" + b"\0" * 40])
def test_refuses_bad_files(kv, content):
    with open(kv, "wb") as f:
        f.write(content)
    with pytest.raises(FormatError):
        KVWriter.open(kv, DIMS)
    with open(kv, "rb") as f:
        assert f.read() == content  # never modified


def test_bad_rows_stage_nothing(kv):
    with KVWriter.open(kv, DIMS) as w:
        w.append(gen_fp8(DIMS, 0, 2))
        bad_shape = gen_fp8(Dims(2, 9, 4, 0, 0, 1000), 2, 1)
        with pytest.raises(FormatError, match="shape"):
            w.append(bad_shape)
        rows = gen_fp8(DIMS, 2, 2)
        for tokens in (np.array([5, 1000]), np.array([-1, 3])):
            with pytest.raises(FormatError, match="token"):
                w.append(RecordRows(tokens=tokens, lc_codes=rows.lc_codes, lc_scale=rows.lc_scale,
                                    rc_codes=rows.rc_codes, rc_scale=rows.rc_scale))
        with pytest.raises(FormatError, match="integers"):
            w.append(RecordRows(tokens=np.array([1.5, 2.0]), lc_codes=rows.lc_codes,
                                lc_scale=rows.lc_scale, rc_codes=rows.rc_codes, rc_scale=rows.rc_scale))
        with pytest.raises(FormatError, match="indexer"):
            w.append(gen_fp8(DIMS_IX, 2, 2))
        assert w.length == 2
    assert read_committed(kv)[1] == 2


def test_nrec_limit(kv, monkeypatch):
    import sessionstore.kvfile.writer as writer_module

    monkeypatch.setattr(writer_module, "MAX_NREC", 3)
    with KVWriter.open(kv, DIMS) as w:
        w.append(gen_fp8(DIMS, 0, 3))
        with pytest.raises(LimitError):
            w.append(gen_fp8(DIMS, 3, 1))


def test_nrec_beyond_file_is_cut_back_on_open(kv):
    with KVWriter.open(kv, DIMS) as w:
        w.append(gen_fp8(DIMS, 0, 5))
    rec = record_size(2, DIMS)
    with open(kv, "r+b") as f:  # as if the file lost its tail: nrec 5, 3.5 records left
        f.truncate(40 + 3 * rec + rec // 2)
    with KVWriter.open(kv, DIMS) as w:
        assert w.nrec == 3
        assert read_committed(kv)[1] == 3  # the commit word now says what is really there
        w.append(gen_fp8(DIMS, 3, 2))
    _, nrec, body, _ = read_committed(kv)
    assert nrec == 5 and body == expected_records(2, DIMS, 5)
    assert_sidecar_sound(kv)


def _engine_file(path: str, n: int) -> None:
    """A file as the engine writes it: header + records, no sidecar."""
    with open(path, "wb") as f:
        f.write(pack_header(Header(2, DIMS, n)) + expected_records(2, DIMS, n))


def _sidecar_count(path: str) -> int:
    side = load_sidecar(path)
    return -1 if side is None else side.count


def test_sidecar_missing_behind_ahead_repaired(kv):
    _engine_file(kv, 6)
    with KVWriter.open(kv, DIMS) as w:  # missing: every committed record gets an entry
        assert w.nrec == 6
    assert _sidecar_count(kv) == 6
    assert_sidecar_sound(kv)
    with open(sidecar_path(kv), "r+b") as f:  # behind: entries cut off (count says 6)
        f.truncate(64 + 8 * 2)
    with KVWriter.open(kv, DIMS):
        pass
    assert _sidecar_count(kv) == 6
    assert_sidecar_sound(kv)
    with open(kv, "r+b") as f:  # ahead: the engine truncated the file to 4 records
        f.seek(32)
        f.write(struct.pack("<i", 4))
    with KVWriter.open(kv, DIMS) as w:
        assert w.nrec == 4
    assert _sidecar_count(kv) == 4


def test_checksums_off_removes_sidecar(kv):
    with KVWriter.open(kv, DIMS) as w:
        w.append(gen_fp8(DIMS, 0, 2))
    assert os.path.exists(sidecar_path(kv))
    with KVWriter.open(kv, DIMS, checksums=False) as w:
        w.append(gen_fp8(DIMS, 2, 2))
    assert not os.path.exists(sidecar_path(kv))
    assert read_committed(kv)[1] == 4


def test_closed_writer_refuses_work(kv):
    w = KVWriter.open(kv, DIMS)
    w.close()
    w.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        w.append(gen_fp8(DIMS, 0, 1))
    assert "closed=True" in repr(w)


def test_events_are_logged_as_json(kv, capsys, monkeypatch):
    monkeypatch.setenv("COLI_LOG", "json")
    store_log.reconfigure()
    try:
        _engine_file(kv, 2)
        with KVWriter.open(kv, DIMS) as w:
            w.append(gen_fp8(DIMS, 2, 2))
            w.commit()
            w.truncate(1)
            with pytest.raises(LockedError):
                KVWriter.open(kv, DIMS)
        events = [json.loads(line)["event"] for line in capsys.readouterr().err.splitlines()
                  if line.startswith("{")]
    finally:
        monkeypatch.setenv("COLI_LOG", "off")
        store_log.reconfigure()
    for event in ("kv.open", "kv.recovery", "kv.commit", "kv.truncate", "kv.lock_refused",
                  "kv.close"):
        assert event in events, events
