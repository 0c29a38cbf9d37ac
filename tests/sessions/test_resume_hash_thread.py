"""A resume whose checksum pass is split across two threads (:mod:`sessionstore.kvfile.hash_threads`)
refuses a bad record in the second thread's share as it refuses one in the first: the turn that
resumed the session fails with one line naming the record, no token is drawn or printed, and the
session's files are left exactly as found; a sound session resumes and continues as before."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sessionstore.kvfile import hash_threads
from sessionstore.kvfile.reader import open_kv
from tests.support.migrate import tree_state
from tools.coli_kv import main

SID = "split"


@pytest.fixture
def split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every resume's pass split, however small the file, as on a host with two usable CPUs."""
    monkeypatch.setattr(hash_threads, "MIN_THREADED_BYTES", 0)
    monkeypatch.setattr(hash_threads, "usable_cpus", lambda: 2)


def _generate(root: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    rc = main(["generate", "--root", str(root), "--session", SID, "--max-new", "2", "--json", *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _files(root: Path) -> dict[str, bytes | str]:
    state = tree_state(root / "sessions" / SID)
    state.pop("kv.coli_kv.lock", None)  # not data: the last holder's pid
    return state


def test_a_bad_record_in_the_second_threads_share_fails_the_turn(tmp_path, capsys, split) -> None:
    root = tmp_path / "R"
    prompt = ",".join(str(72 + i % 40) for i in range(24))  # 24 records fed, one drawn
    assert _generate(root, capsys, "--model", "tiny", "--prompt-ids", prompt, "--kv", "fp8")[0] == 0
    kv = root / "sessions" / SID / "kv.coli_kv"
    with open_kv(kv) as reader:
        n, rec = reader.nrec, reader.record_bytes
    bad = n - 3
    assert bad >= hash_threads.threaded_split(n, rec)  # in the thread's share
    raw = bytearray(kv.read_bytes())
    raw[40 + bad * rec + 21] ^= 0x08
    kv.write_bytes(bytes(raw))
    before = _files(root)
    rc, out, err = _generate(root, capsys)
    assert rc != 0 and out == ""  # nothing drawn, nothing printed
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err
    assert f"record at position {bad} (byte {40 + bad * rec})" in lines[0]
    assert _files(root) == before
    raw[40 + bad * rec + 21] ^= 0x08  # the same bit back: the session is sound again
    kv.write_bytes(bytes(raw))
    rc, out, err = _generate(root, capsys)
    assert rc == 0, err
    assert len(json.loads(out.strip().splitlines()[-1])["tokens"]) == 2
