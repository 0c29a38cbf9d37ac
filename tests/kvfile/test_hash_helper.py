"""The checksum helper process: a large check shares its records with a second process and
still condemns any record that fails, in either share (a resume's gathering pass hashes them all
itself); a helper that cannot hash (another file at the path, an error) leaves the work to the
caller; the helper dies with its parent."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kernels.errors import CorruptionError
from sessionstore.kvfile import integrity
from sessionstore.kvfile.hash_helper import start_hash_helper, stop_hash_helper
from sessionstore.kvfile.hash_worker import hash_file_records
from sessionstore.kvfile.header import HEADER_SIZE, record_bytes
from sessionstore.kvfile.integrity import require_vouched
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import hash_records, write_sidecar_for
from tests.kvfile.test_layout_fixtures import ENGINE_TOKENS, INDEXER_DIMS, fp8_rows, write_kv

REC = record_bytes(2, INDEXER_DIMS)
NREC = 45


@pytest.fixture
def helper(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(integrity, "MIN_SHARED_BYTES", 0)  # every range is shared, however small
    start_hash_helper()
    try:
        yield
    finally:
        stop_hash_helper()


def _vouched_file(tmp_path: Path) -> Path:
    path = write_kv(tmp_path / ".coli_kv", 2, INDEXER_DIMS, fp8_rows(INDEXER_DIMS, ENGINE_TOKENS), nrec=NREC)
    with open_kv(path) as kv:
        write_sidecar_for(kv)
    return path


def _flip(path: Path, position: int) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + position * REC + 11)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def test_the_helpers_checksums_are_the_readers(tmp_path: Path) -> None:
    path = _vouched_file(tmp_path)
    with open_kv(path) as kv:
        mine = hash_records(kv, 7, NREC)
        theirs = np.frombuffer(hash_file_records(str(path), kv.identity, HEADER_SIZE, REC, 7, NREC), "<u8")
        assert np.array_equal(mine, theirs)
        with pytest.raises(FileNotFoundError, match="not the file the reader mapped"):
            hash_file_records(str(path), (kv.identity[0], kv.identity[1] + 1), HEADER_SIZE, REC, 0, 3)


@pytest.mark.parametrize("bad", [3, NREC - 2])  # one in this process's share, one in the helper's
def test_a_shared_check_condemns_a_bad_record_in_either_share(tmp_path: Path, helper: None, bad: int) -> None:
    path = _vouched_file(tmp_path)
    with open_kv(path) as kv:
        assert require_vouched(kv, NREC).checked == NREC
    _flip(path, bad)
    with open_kv(path) as kv, pytest.raises(CorruptionError, match=f"record at position {bad} "):
        require_vouched(kv, NREC)


class _CountingHelper:
    """Stands for the running helper: counts what it is asked, hashes nothing."""

    def __init__(self) -> None:
        self.asked = 0

    def submit(self, *args: object) -> object:
        self.asked += 1
        return lambda: None  # could not hash: the caller would hash the share itself


@pytest.mark.parametrize("bad", [3, NREC - 2])
def test_a_gathering_check_hashes_every_record_here_and_gathers_the_same_scales(
        tmp_path: Path, helper: None, monkeypatch: pytest.MonkeyPatch, bad: int) -> None:
    """A resume's pass (scales gathered while each block is in cache) never hands a share to the
    helper, condemns a bad record anywhere, and gathers what a reader's own pass gathers."""
    path = _vouched_file(tmp_path)
    counting = _CountingHelper()
    monkeypatch.setattr(integrity, "active_hash_helper", lambda: counting)
    with open_kv(path) as kv, open_kv(path) as plain:
        assert require_vouched(kv, NREC, gather_scales=True).checked == NREC
        assert np.array_equal(kv.sanitized_scales(), plain.sanitized_scales())
    with open_kv(path) as kv:
        assert require_vouched(kv, NREC).checked == NREC  # the plain check does ask it
    assert counting.asked == 1
    _flip(path, bad)
    with open_kv(path) as kv, pytest.raises(CorruptionError, match=f"record at position {bad} "):
        require_vouched(kv, NREC, gather_scales=True)
    assert counting.asked == 1


def test_a_helper_that_cannot_hash_leaves_the_check_to_the_caller(tmp_path: Path, helper: None) -> None:
    path = _vouched_file(tmp_path)
    _flip(path, NREC - 1)  # in the helper's share
    with open_kv(path) as kv:
        kv.identity = (-1, -1)  # the helper refuses: not the file it finds at the path
        with pytest.raises(CorruptionError, match=f"record at position {NREC - 1} "):
            require_vouched(kv, NREC)


def test_the_helper_dies_with_its_parent(tmp_path: Path) -> None:
    code = ("import os, time\n"
            "from sessionstore.kvfile.hash_helper import start_hash_helper\n"
            "start_hash_helper()\n"
            "time.sleep(1.5)\n"
            "print(' '.join(l.split()[0] for l in os.popen(f'ps -o pid= --ppid {os.getpid()}')), flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    assert parent.stdout is not None
    children = [int(p) for p in parent.stdout.readline().split()]
    assert children, "the helper process did not start"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    alive = children
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _running(p)]
    assert not alive, f"helper process(es) {alive} outlived their killed parent"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_helper_imports_nothing_of_ours(tmp_path: Path) -> None:
    """The helper is a small program: no numpy, numba or package of ours is imported by it."""
    from sessionstore.kvfile.hash_helper import WORKER

    done = subprocess.run([sys.executable, "-I", "-X", "importtime", str(WORKER)], input=b"", capture_output=True,
                          timeout=60, check=True)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.decode().splitlines()
                if line.startswith("import time:")}
    assert "xxhash" in imported
    assert not imported & {"numpy", "numba", "sessionstore", "kernels"}, imported


def test_answers_reach_the_threads_that_asked(tmp_path: Path, helper: None) -> None:
    """Ranges asked from several threads at once each get their own checksums."""
    from concurrent.futures import ThreadPoolExecutor

    from sessionstore.kvfile.hash_helper import active_hash_helper

    path = _vouched_file(tmp_path)
    running = active_hash_helper()
    assert running is not None
    with open_kv(path) as kv:
        ranges = [(a, min(a + 1 + a % 5, NREC)) for a in range(0, NREC, 2)]

        def ask(r: tuple[int, int]) -> bool:
            found = running.submit(str(path), kv.identity, HEADER_SIZE, REC, *r)()
            return found is not None and np.array_equal(found, hash_records(kv, *r))

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(ask, ranges * 4))
