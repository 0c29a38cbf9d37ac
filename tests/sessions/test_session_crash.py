"""Crashes (real SIGKILL) and concurrent writers: no committed token lost, resume stays exact.

Recovery rule under test (FORMAT.md section 5): the kv file's commit word is the commit
point. If the manifest disagrees with it (killed between the kv commit and the manifest
replace, killed inside a truncate, or an unsynced manifest lost), open takes the file's count
and recomputes the pending token from the last position's logits (sampling depends only on
(seed, position, logits)).
"""
from __future__ import annotations

import random
import shutil
import signal
import time

import pytest

from kernels.errors import LockedError
from kernels.model.sampling import Sampler
from sessionstore.sessions import SessionOptions
from sessionstore.sessions.directory import STATE_NAME
from sessionstore.sessions.manifest import MANIFEST_NAME
from sessionstore.sessions.snapshot import verify_session_dir
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turn_loop import reference_turns
from tests.support.session_util import run_child, spawn_child

PROMPT = list(b"Once upon a time")
SAMPLERS = {"greedy": (0.0, 0, 1.0, 0), "sampled": (0.9, 50, 0.95, 4242)}



def _check_prefix_and_continue(root, sid: str, tiny, kv: str, sampler: Sampler,
                               total: int) -> dict:
    """The recovered history is a prefix of the uninterrupted run; continuing completes it exactly."""
    stream = PROMPT + reference_turns(tiny, kv, [(PROMPT, total)], sampler)[0]
    s = SessionStore(root).open(sid)
    report = dict(s.resume_report)
    history = s.history()
    assert history == stream[:len(history)], "recovered history is not a prefix of the run"
    assert len(history) >= len(PROMPT) + 1  # the prompt turn was committed before any kill
    rest = total - (len(history) - len(PROMPT))
    assert s.generate(None, rest).tokens == stream[len(history):]
    s.close()
    return report


@pytest.mark.parametrize("kv, mode", [("fp8", "sampled"), ("f32", "greedy"), ("fp8", "greedy"),
                                      ("f32", "sampled"), ("int4", "sampled"), ("polar4", "greedy")])
def test_sigkill_at_random_moments(tmp_path, tiny, kv, mode) -> None:
    rng = random.Random(f"{kv}-{mode}")
    sampler = Sampler(*SAMPLERS[mode])
    total, commit_every = 250, rng.choice([1, 3])
    root = str(tmp_path)
    for kill in range(3):  # kill, recover, kill again (later runs resume a recovered session)
        job = {"id": "s", "max_new": total, "commit_every": commit_every}
        if kill == 0:
            job.update(create={"kv": kv, "sampler": list(SAMPLERS[mode])}, prompt=PROMPT)
            first_length = len(PROMPT)  # cache length when the first token is sampled
        else:
            history = SessionStore(root).history("s")
            job["max_new"] = total - (len(history) - len(PROMPT))
            first_length = SessionStore(root).info("s").tokens + 1  # the pending token is fed first
        proc = spawn_child({"root": root, "jobs": [job], "stream": True})
        seen, stop_after = 0, rng.randint(3, 40)
        while seen < stop_after:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            seen += line.startswith("tok ")
        time.sleep(rng.random() * 0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        # when line j was printed, the commit due at step j-1 had completed
        floor = first_length + seen - 1 - commit_every
        assert SessionStore(root).info("s").tokens >= floor  # acknowledged commits survive
    report = _check_prefix_and_continue(root, "s", tiny, kv, sampler, total)
    assert report["verified"] in ("bit-identical", "recomputed (no digest to compare)")


@pytest.mark.parametrize("kill_at", [3, 6])
def test_sigkill_between_kv_commit_and_manifest(tmp_path, tiny, kill_at) -> None:
    """The kv commit landed, the manifest did not: open recovers to the file's count, exact."""
    sampler = Sampler(*SAMPLERS["sampled"])
    spec = {"root": str(tmp_path), "kill_at_manifest_write": kill_at,
            "jobs": [{"id": "s", "create": {"kv": "fp8", "sampler": list(SAMPLERS["sampled"])},
                      "prompt": PROMPT, "max_new": 30, "commit_every": 2}]}
    with pytest.raises(AssertionError, match=f"child failed \\(-{int(signal.SIGKILL)}\\)"):
        run_child(spec)
    store = SessionStore(tmp_path)
    manifest = store.read_manifest("s")
    from sessionstore.kvfile.reader import open_kv

    with open_kv(store.kv_path("s")) as reader:
        assert reader.nrec > manifest.committed  # the disagreement the rule is about
    report = _check_prefix_and_continue(tmp_path, "s", tiny, "fp8", sampler, 30)
    assert report["recovered"] is True


def test_sigkill_inside_truncate(tmp_path, tiny) -> None:
    """Killed after the manifest's epoch bump, before the kv cut: the pre-truncate state returns."""
    sampler = Sampler(*SAMPLERS["sampled"])
    run_child({"root": str(tmp_path), "jobs": [
        {"id": "s", "create": {"kv": "f32", "sampler": list(SAMPLERS["sampled"])},
         "prompt": PROMPT, "max_new": 8}]})
    diverged = PROMPT[:5] + [1, 2, 3]
    with pytest.raises(AssertionError, match="child failed"):
        run_child({"root": str(tmp_path), "kill_at_kv_truncate": True,
                   "jobs": [{"id": "s", "prompt": diverged, "max_new": 4}]})
    store = SessionStore(tmp_path)
    assert store.read_manifest("s").committed == 5  # the manifest already said "cut"
    s = store.open("s")
    assert s.resume_report["recovered"] is True
    expected = reference_turns(tiny, "f32", [(PROMPT, 8), (None, 6)], sampler)
    assert s.history() == PROMPT + expected[0]  # nothing committed was lost
    assert s.generate(None, 6).tokens == expected[1]
    assert s.generate(diverged, 4).tokens == reference_turns(
        tiny, "f32", [(PROMPT, 8), (None, 6), (diverged, 4)], sampler)[2]
    s.close()


def test_lost_unsynced_manifest(tmp_path, tiny) -> None:
    """An OS crash may lose manifest updates (they are not fsynced): an older one still resumes exactly."""
    sampler = Sampler(*SAMPLERS["greedy"])
    store = SessionStore(tmp_path)
    s = store.create("s", "tiny", kv_dtype="fp8", sampler=sampler, options=SessionOptions(commit_every=64))
    s.generate(PROMPT, 5)
    s.close()
    names = (MANIFEST_NAME, STATE_NAME)  # the manifest and its commit state page (per commit)
    for name in names:
        shutil.copy(store.session_dir("s") / name, tmp_path / f"old-{name}")
    s = SessionStore(tmp_path).open("s")
    s.generate(None, 7)
    s.close()

    def lose_updates() -> None:  # the newer manifest and state page "never hit the disk"
        for name in names:
            shutil.copy(tmp_path / f"old-{name}", store.session_dir("s") / name)

    lose_updates()
    # skipping verification never skips recovery
    quick = SessionStore(tmp_path).open("s", options=SessionOptions(verify=False))
    assert quick.resume_report["recovered"] is True
    quick.abandon()
    lose_updates()
    report = _check_prefix_and_continue(tmp_path, "s", tiny, "fp8", sampler, 5 + 7 + 4)
    assert report["recovered"] is True


def test_two_writers_second_is_refused_at_once(tmp_path) -> None:
    run_child({"root": str(tmp_path), "jobs": [
        {"id": "s", "create": {"kv": "fp8"}, "prompt": PROMPT, "max_new": 4}]})
    before = SessionStore(tmp_path).history("s")
    holder = spawn_child({"root": str(tmp_path), "announce": True, "hold": True,
                          "jobs": [{"id": "s", "max_new": 3}]})
    try:
        assert holder.stdout.readline().strip() == "ready"
        store = SessionStore(tmp_path)
        t0 = time.perf_counter()
        with pytest.raises(LockedError, match="another writer"):
            store.open("s")
        with pytest.raises(LockedError):
            store.delete("s")
        assert time.perf_counter() - t0 < 2.0  # refused at once, never waiting
        t0 = time.perf_counter()
        assert [i.id for i in store.directory.list()] == ["s"]  # listing never waits on the lock
        store.fork("s", "copy")  # readers (snapshot copies) are not blocked either
        assert time.perf_counter() - t0 < 2.0
        assert store.history("copy") == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert holder.returncode == 0
    verify_session_dir(SessionStore(tmp_path).session_dir("s"))
    after = SessionStore(tmp_path).history("s")
    assert after[:len(before) - 1] == before[:-1] and len(after) == len(before) + 3


def test_two_writers_in_one_process(tmp_path) -> None:
    a = SessionStore(tmp_path).create("s", "tiny", kv_dtype="f32")
    a.generate(PROMPT, 3)
    with pytest.raises(LockedError):
        SessionStore(tmp_path).open("s")
    a.generate(None, 2)
    a.close()
    b = SessionStore(tmp_path).open("s")
    assert b.resume_report["verified"] == "bit-identical"
    b.close()
