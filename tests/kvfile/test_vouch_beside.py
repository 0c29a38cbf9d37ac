"""The checksum pass beside (``integrity.start_vouching``, ``KVWriter.open(vouch_beside=True)``): it
finds what the serial pass finds, raises the serial pass's error, runs only when no repair would touch
the files, and a writer's close waits for it. Each case a few tens of ms."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sessionstore.kvfile.integrity as integrity
from kernels.errors import ChecksumMismatchError
from sessionstore.kvfile import HEADER_SIZE, KVWriter, PendingCheck, Vouched, open_kv, require_vouched
from sessionstore.kvfile.hash_helper import start_hash_helper, stop_hash_helper
from sessionstore.kvfile.integrity import start_vouching
from sessionstore.kvfile.reader import KVReader
from tests.kvfile.test_layout_fixtures import ENGINE_TOKENS, INDEXER_DIMS, fp8_rows


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "kv.coli_kv"
    with KVWriter.open(path, INDEXER_DIMS, kv_dtype="fp8", create=True) as writer:
        writer.append(fp8_rows(INDEXER_DIMS, ENGINE_TOKENS))
        writer.commit()
    return path


def _flip(path: Path, position: int) -> None:
    with open_kv(path) as reader:
        rec = reader.record_bytes
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + position * rec + rec // 3] ^= 0x21
    path.write_bytes(bytes(raw))


def test_a_clean_file_is_vouched_for_beside_as_serially(tmp_path: Path) -> None:
    path = _file(tmp_path)
    with open_kv(path) as reader:
        pending = start_vouching(reader, reader.nrec)
        assert isinstance(pending, PendingCheck)
        found = pending.result()
        assert found == require_vouched(reader, reader.nrec) == Vouched(checked=reader.nrec, not_covered=0,
                                                                          sidecar=True)
        assert pending.passed() and pending.seconds > 0


@pytest.mark.parametrize("hashed_by", ["thread", "helper"])
@pytest.mark.parametrize("position", [0, 20, -1])
def test_a_corrupt_record_raises_the_serial_error_beside(tmp_path: Path, position: int, hashed_by: str,
                                                         request: pytest.FixtureRequest) -> None:
    """Hashed on the pass's thread, or by the checksum helper process (a server runs one)."""
    if hashed_by == "helper":
        request.getfixturevalue("helper")
    path = _file(tmp_path)
    with open_kv(path) as reader:
        n = reader.nrec
    _flip(path, position % n)
    with open_kv(path) as reader:
        with pytest.raises(ChecksumMismatchError) as serial:
            require_vouched(reader, n)
        pending = start_vouching(reader, n)
        assert pending is not None
        with pytest.raises(ChecksumMismatchError) as beside:
            pending.result()
        assert not pending.passed()
    assert str(beside.value) == str(serial.value) and f"position {position % n} " in str(beside.value)


def test_no_pass_beside_without_a_sidecar(tmp_path: Path) -> None:
    """Nothing vouches (another writer's file): the serial rule decides (not covered)."""
    path = tmp_path / "kv.coli_kv"
    with KVWriter.open(path, INDEXER_DIMS, kv_dtype="fp8", create=True, checksums=False) as writer:
        writer.append(fp8_rows(INDEXER_DIMS, ENGINE_TOKENS))
        writer.commit()
    with open_kv(path) as reader:
        assert start_vouching(reader, reader.nrec) is None


def test_no_pass_beside_when_a_repair_would_touch_the_files(tmp_path: Path) -> None:
    """The file cut inside its last committed record (the commit word counts one more than the file
    holds, a repair would cut it back): checked serially, before that repair, as without beside."""
    path = _file(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 7)
    with open_kv(path) as reader:
        assert reader.nrec == len(ENGINE_TOKENS) - 1 < reader.header.nrec
        assert start_vouching(reader, reader.nrec) is None
    writer = KVWriter.open(path, INDEXER_DIMS, kv_dtype="fp8", create=False, vouch=0, vouch_beside=True)
    try:
        assert writer.vouched is not None and writer.vouched.pending is None  # the serial pass ran
    finally:
        writer.close(commit=False)


def test_a_writer_opened_beside_holds_the_pass_and_its_close_waits_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path)
    let_go = threading.Event()
    real = integrity.hash_records

    def held(reader: Any, start: int, stop: int) -> np.ndarray:
        assert let_go.wait(30)
        return real(reader, start, stop)

    monkeypatch.setattr(integrity, "hash_records", held)
    writer = KVWriter.open(path, INDEXER_DIMS, kv_dtype="fp8", create=False, vouch=len(ENGINE_TOKENS),
                           vouch_beside=True)
    vouched = writer.vouched
    assert vouched is not None and vouched.pending is not None  # provisional while the pass runs
    assert "running beside" in vouched.describe()
    reader = writer.take_vouched_reader()
    assert reader is not None
    timer = threading.Timer(0.2, let_go.set)
    timer.start()
    t0 = time.perf_counter()
    writer.close(commit=False)
    assert time.perf_counter() - t0 >= 0.15 and vouched.pending.done()  # the close waited for the pass
    assert vouched.pending.result().checked == len(ENGINE_TOKENS) and writer.vouched == vouched.pending.result()
    assert np.array_equal(reader.tokens, np.asarray(ENGINE_TOKENS, dtype="<i4"))
    reader.close()


def test_a_second_pass_runs_while_the_first_is_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The passes run on kept threads (no thread started per resume): one held does not hold another
    session's, and each runs on a thread named as before."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    held_path, other = _file(tmp_path / "a"), _file(tmp_path / "b")
    let_go, names = threading.Event(), set()
    real = integrity.hash_records

    def held(reader: Any, start: int, stop: int) -> np.ndarray:
        names.add(threading.current_thread().name)
        if reader.path == str(held_path):
            assert let_go.wait(30)
        return real(reader, start, stop)

    monkeypatch.setattr(integrity, "hash_records", held)
    with open_kv(held_path) as first, open_kv(other) as second:
        pending_first = start_vouching(first, first.nrec)
        pending_second = start_vouching(second, second.nrec)
        assert pending_first is not None and pending_second is not None
        assert pending_second.result().checked == second.nrec  # while the first is still held
        assert not pending_first.done()
        let_go.set()
        assert pending_first.result().checked == first.nrec
    assert names == {"coli-vouch"}


def test_a_writer_opened_beside_keeps_its_pass_after_it_passed_and_gathers_the_tokens_once(
        tmp_path: Path) -> None:
    """The pass is still the caller's to take once it has passed (``vouching.pending``; ``vouched``
    then gives its result); the tokens were gathered into one contiguous copy before it started."""
    path = _file(tmp_path)
    writer = KVWriter.open(path, INDEXER_DIMS, kv_dtype="fp8", create=False, vouch=len(ENGINE_TOKENS),
                           vouch_beside=True)
    try:
        pending = writer.vouching.pending
        assert pending is not None
        pending.wait()
        assert writer.vouching.pending is pending and writer.vouched == pending.result()
        reader = writer.take_vouched_reader()
        assert reader is not None
        tokens = reader.token_copy()
        assert tokens is reader.token_copy() and tokens.flags.c_contiguous  # gathered once
        assert np.array_equal(tokens, np.asarray(ENGINE_TOKENS, dtype="<i4"))
        reader.close()
    finally:
        writer.close(commit=False)


# ---- the pass beside in the checksum helper process (a server runs one) -----------------------


def _refuse_local_hashing(reader: KVReader, start: int, stop: int) -> np.ndarray:
    raise AssertionError(f"records [{start}, {stop}) hashed on a thread of this process")


@pytest.fixture
def helper(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(integrity, "MIN_SHARED_BYTES", 0)  # the small test file counts as large
    start_hash_helper()
    try:
        yield
    finally:
        stop_hash_helper()


def test_the_pass_beside_hashes_in_the_helper_process(tmp_path: Path, helper: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path)
    monkeypatch.setattr(integrity, "hash_records", _refuse_local_hashing)
    with open_kv(path) as reader:
        pending = start_vouching(reader, reader.nrec)
        assert pending is not None
        assert pending.result() == Vouched(checked=reader.nrec, not_covered=0, sidecar=True)


def test_without_a_helper_the_pass_hashes_on_its_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path)
    monkeypatch.setattr(integrity, "hash_records", _refuse_local_hashing)
    with open_kv(path) as reader:
        pending = start_vouching(reader, reader.nrec)
        assert pending is not None
        with pytest.raises(AssertionError, match="hashed on a thread of this process"):
            pending.result()
