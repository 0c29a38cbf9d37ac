"""A resume's checksum pass split across two threads of this process (:mod:`sessionstore.kvfile.hash_threads`):
the second thread's share is compared like the caller's, a bad record in either share is condemned
(and named), the scales of both shares are gathered exactly as the reading rule gives them, and a
small range or a host with one usable CPU keeps the pass on one thread."""
from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from kernels.errors import ChecksumMismatchError
from sessionstore.kvfile import KVWriter, hash_threads, integrity, open_kv, require_vouched
from sessionstore.kvfile.header import HEADER_SIZE
from tests.kvfile.test_layout_fixtures import ENGINE_TOKENS, INDEXER_DIMS, fp8_rows

NREC = 45


@pytest.fixture
def split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every range split, however small, as on a host with two usable CPUs."""
    monkeypatch.setattr(hash_threads, "MIN_THREADED_BYTES", 0)
    monkeypatch.setattr(hash_threads, "usable_cpus", lambda: 2)


def _file(tmp_path: Path) -> Path:
    """A v2 file our writer committed (its sidecar vouches for every record), unusable scales in both halves."""
    rows = fp8_rows(INDEXER_DIMS, ENGINE_TOKENS)
    rows.lc_scale[3, 0] = 0.0
    rows.rc_scale[40, 1] = np.nan
    path = tmp_path / "kv.coli_kv"
    with KVWriter.open(path, INDEXER_DIMS, kv_dtype="fp8", create=True) as writer:
        writer.append(rows)
        writer.commit()
    return path


def _flip(path: Path, position: int) -> None:
    with open_kv(path) as kv:
        rec = kv.record_bytes
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + position * rec + 17)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x20]))


def test_the_split_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hash_threads, "usable_cpus", lambda: 2)
    big = hash_threads.MIN_THREADED_BYTES
    assert hash_threads.threaded_split(1000, big // 1000 - 1) == 1000  # under the threshold: one thread
    assert hash_threads.threaded_split(1000, big // 1000 + 1) == 500  # the second thread takes the last half
    monkeypatch.setattr(hash_threads, "usable_cpus", lambda: 1)
    assert hash_threads.threaded_split(1000, big) == 1000  # one usable CPU: one thread


def test_a_split_pass_gathers_the_scales_of_both_shares(tmp_path: Path, split: None) -> None:
    path = _file(tmp_path)
    with open_kv(path) as kv:
        want = np.array(kv.sanitized_scales())  # [2, L, n] f32: the reading rule, one thread
    with open_kv(path) as kv:
        assert hash_threads.threaded_split(NREC, kv.record_bytes) < NREC  # the pass is split
        assert require_vouched(kv, NREC, gather_scales=True).checked == NREC
        assert kv.scales_gathered == NREC  # both shares counted once both ended
        got = kv.sanitized_scales()
        assert np.array_equal(got, want)
        assert got[0, 0, 3] == 0 and got[1, 1, 40] == 0  # inert rows in either share read as 0


@pytest.mark.parametrize("bad", [2, NREC - 3])  # one in the caller's share, one in the thread's
def test_a_split_pass_condemns_a_bad_record_in_either_share(tmp_path: Path, split: None, bad: int) -> None:
    path = _file(tmp_path)
    _flip(path, bad)
    with open_kv(path) as kv:
        assert (bad < hash_threads.threaded_split(NREC, kv.record_bytes)) == (bad == 2)
        with pytest.raises(ChecksumMismatchError, match=f"record at position {bad} "):
            require_vouched(kv, NREC, gather_scales=True)


def test_a_failed_second_thread_leaves_its_share_to_the_caller(tmp_path: Path, split: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path)
    _flip(path, NREC - 1)

    class Broken:
        """Stands for the hashing thread: its share ends in an error, as a thread's failure would."""

        def submit(self, *args: object) -> Future[None]:
            failed: Future[None] = Future()
            failed.set_exception(RuntimeError("the thread failed"))
            return failed

    monkeypatch.setattr(integrity, "hash_thread", lambda: Broken())
    with open_kv(path) as kv:
        with pytest.raises(ChecksumMismatchError, match=f"record at position {NREC - 1} "):
            require_vouched(kv, NREC, gather_scales=True)
    _flip(path, NREC - 1)  # the same bit back: the file is sound again
    with open_kv(path) as kv:
        want = np.array(kv.sanitized_scales())  # [2, L, n] f32
    with open_kv(path) as kv:  # the failed thread's share hashed and gathered here
        assert require_vouched(kv, NREC, gather_scales=True).checked == NREC
        assert np.array_equal(kv.sanitized_scales(), want)
