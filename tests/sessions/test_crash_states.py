"""Every crash state a POSIX file system may leave during a session's protocols, checked
(FORMAT.md 3.9; issue 26 part 1): the decode loop's commits and a suspend, a creation and its
first turn, a fork, a bundle import.

Built as in ``tests/kvfile/test_crash_states.py`` (record, build the states, sample with seed 26).
Every state is checked without the model: the session's kv file reads as a prefix of the
uninterrupted run's records, holding every record committed before the crash (the larger of the
acknowledged commits and the fsynced commit word), and its sidecar never vouches for a wrong
record; a session whose creation (fork, import) was acknowledged exists. One state in
``OPEN_EVERY`` is also opened the way a user opens it, :meth:`SessionStore.open` with the tiny
model (store sweep, kv recovery, manifest recovery with the last position recomputed,
verification): its history must be a prefix of the uninterrupted run's, with every committed
record. Run with ``pytest -k crash_state``.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernels.errors import ColiError
from kernels.model.sampling import Sampler
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import load_sidecar
from sessionstore.kvfile.sidecar_check import check_records
from sessionstore.sessions import SessionOptions
from sessionstore.sessions.store import SessionStore
from tests.support.crash_explore import Exploration, explore, last_ack, record
from tests.support.crash_states import CrashPoint
from tests.support.crash_trace import Recorder
from tests.support.io_starters import DeferredStarter

PROMPT = list(b"Once upon a time")
SAMPLER = Sampler(0.9, 50, 0.95, 4242)
BUDGET = 3000  # distinct states per crash point and sector size
OPEN_EVERY = 10  # one state in this many is also opened with the model


def _report(result: Exploration) -> None:
    print(result.summary())
    assert not result.failures, result.summary() + "\n" + "\n".join(result.failures)


class SessionCheck:
    """Checks session ``sid`` of a store at a state's directory against the uninterrupted
    run: its committed records (``records``, bytes) and its history (``stream``)."""

    def __init__(self, tiny, sid: str, records: bytes, record_bytes: int, stream: list[int],
                 *, others: tuple[str, ...] = (), whole: bool = False) -> None:
        self.tiny = tiny
        self.sid = sid
        self.records = records
        self.rec = record_bytes
        self.stream = stream
        self.others = others  # sessions that must open whatever the state (the fork's source)
        self.whole = whole  # the session, when present, holds every record (a fork is installed whole)
        self.checked = 0
        self.opened = 0

    def kv_prefix(self, root: str, committed: int) -> int:
        path = os.path.join(root, "sessions", self.sid, "kv.coli_kv")
        with open_kv(path) as reader:
            n = reader.nrec
            assert committed <= n <= len(self.records) // self.rec, f"{n} records, committed {committed}"
            assert not self.whole or n * self.rec == len(self.records), f"a partial session: {n} records"
            body = bytes(reader.records_bytes_view(0, n)) if n else b""
            assert body == self.records[:n * self.rec], "records differ from the uninterrupted run's"
            side = load_sidecar(path)
            if side is not None:
                report = check_records(reader, side)
                assert report.sound and not report.mismatched, f"sidecar vouches wrongly: {report}"
        return n

    def __call__(self, root: str, committed: int) -> None:
        """``committed`` < 0: the session may not exist yet (its creation was not acknowledged);
        else it must, with at least that many records."""
        exists = _exists(root, self.sid)
        assert exists or committed < 0, f"session {self.sid} is gone, its creation was acknowledged"
        committed = max(committed, 0)
        n = self.kv_prefix(root, committed) if exists else 0
        self.checked += 1
        if (self.checked - 1) % OPEN_EVERY:
            return
        self.opened += 1
        store = SessionStore(root)
        store.adopt_model("tiny", self.tiny)
        for sid in self.others:
            store.open(sid, "tiny").close()
        if not exists:
            return
        s = store.open(self.sid, "tiny")
        try:
            history = s.history()
            assert s.committed == n >= committed, f"reopened with {s.committed} records, the file has {n}"
            assert history == self.stream[:len(history)], "the reopened history is not a prefix of the run"
        finally:
            s.close()
        assert self.kv_prefix(root, committed) >= committed


def _exists(root: str, sid: str) -> bool:
    return os.path.isdir(os.path.join(root, "sessions", sid))


def _bound(sid: str):
    """The records the all-dropped state's fsynced commit word holds; -1 when the session is
    not there (it may then be absent in every state)."""
    def bound(directory: str) -> int:
        try:
            with open_kv(os.path.join(directory, "sessions", sid, "kv.coli_kv")) as reader:
                return reader.nrec
        except (ColiError, OSError):
            return -1
    return bound


def _records_of(root: Path, sid: str) -> tuple[bytes, int]:
    with open_kv(root / "sessions" / sid / "kv.coli_kv") as reader:
        return bytes(reader.records_bytes_view(0, reader.nrec)), reader.record_bytes


# -- decode-loop commits, then suspend -----------------------------------------------------------

@pytest.fixture(scope="module")
def stream(tiny) -> list[int]:
    """The uninterrupted run: the prompt, then 24 sampled tokens."""
    from sessionstore.sessions.turn_loop import reference_turns

    return PROMPT + reference_turns(tiny, "fp8", [(PROMPT, 24)], SAMPLER)[0]


def _setup_session(tiny, commit_every: int):
    def setup(root: str) -> None:
        store = SessionStore(root)
        store.adopt_model("tiny", tiny)
        s = store.create("s", "tiny", kv_dtype="fp8", sampler=SAMPLER,
                         options=SessionOptions(commit_every=commit_every))
        s.generate(PROMPT, 4)
        s.close()
    return setup


def _decode_and_suspend(tiny, commit_every: int):
    def protocol(root: str, rec: Recorder) -> None:
        store = SessionStore(root)
        store.adopt_model("tiny", tiny)
        s = store.open("s", "tiny", options=SessionOptions(commit_every=commit_every))
        s.generate(None, 20)  # commits every ``commit_every`` tokens (write-behind, headroom)
        rec.mark("ack", s.committed)
        s.suspend()
        rec.mark("ack", s.manifest.committed)
    return protocol


def test_crash_state_decode_and_suspend(tmp_path, tiny, stream) -> None:
    rec = record(str(tmp_path / "root"), _setup_session(tiny, 3), _decode_and_suspend(tiny, 3))
    records, rec_bytes = _records_of(tmp_path / "root", "s")
    check = SessionCheck(tiny, "s", records, rec_bytes, stream)
    result = explore("session decode loop + suspend", rec, check, budget=BUDGET, bound=_bound("s"),
                     strict_rename=True)
    print(f"  opened with the model: {check.opened}")
    _report(result)
    assert check.opened > 0


# -- create + first turn --------------------------------------------------------------------------

def _create_and_turn(tiny):
    def protocol(root: str, rec: Recorder) -> None:
        store = SessionStore(root)
        store.adopt_model("tiny", tiny)
        s = store.create("n", "tiny", kv_dtype="fp8", sampler=SAMPLER, options=SessionOptions(commit_every=3))
        rec.mark("ack", 0)
        s.generate(PROMPT, 8)
        rec.mark("ack", s.committed)
        s.close()
    return protocol


def test_crash_state_create_and_first_turn(tmp_path, tiny, stream) -> None:
    root = tmp_path / "root"
    rec = record(str(root), lambda where: SessionStore(where).directory.sweep(), _create_and_turn(tiny))
    records, rec_bytes = _records_of(root, "n")
    check = SessionCheck(tiny, "n", records, rec_bytes, stream)
    result = explore("session create + first turn", rec, check, budget=BUDGET, bound=_bound("n"),
                     acked=lambda ops, k: last_ack(ops, k, before=-1), strict_rename=True)
    print(f"  opened with the model: {check.opened}")
    _report(result)


# -- create behind its first turn (issue 36 part 3) ---------------------------------------------------

def _create_behind_and_turn(tiny, on_poll: bool):
    """The files made while the first turn runs (``io_start``), on the session's own thread at a
    fixed point so the recorder sees one order: right after the prompt's prefill (``on_poll``:
    the first hand-over of rows asks whether they are there) or at the first commit (which waits
    for them). Nothing is acknowledged before the turn's commit: the session may be absent until then."""
    def protocol(root: str, rec: Recorder) -> None:
        store = SessionStore(root)
        store.adopt_model("tiny", tiny)
        s = store.create("n", "tiny", kv_dtype="fp8", sampler=SAMPLER,
                         options=SessionOptions(commit_every=3, io_start=DeferredStarter(on_poll=on_poll)))
        s.generate(PROMPT, 8)
        rec.mark("ack", s.committed)
        s.close()
    return protocol


@pytest.mark.parametrize("on_poll", [True, False], ids=["made-after-prefill", "made-at-first-commit"])
def test_crash_state_create_behind_and_first_turn(tmp_path, tiny, stream, on_poll: bool) -> None:
    root = tmp_path / "root"
    rec = record(str(root), lambda where: SessionStore(where).directory.sweep(), _create_behind_and_turn(tiny, on_poll))
    records, rec_bytes = _records_of(root, "n")
    check = SessionCheck(tiny, "n", records, rec_bytes, stream)
    result = explore("session created behind its first turn", rec, check, budget=BUDGET, bound=_bound("n"),
                     acked=lambda ops, k: last_ack(ops, k, before=-1), strict_rename=True)
    print(f"  opened with the model: {check.opened}")
    _report(result)
    assert check.opened > 0


# -- fork ----------------------------------------------------------------------------------------

def _fork(root: str, rec: Recorder) -> None:
    store = SessionStore(root)
    store.fork("s", "f")
    rec.mark("forked", 1)


def _forked(ops, k: int) -> int:
    return 1 if any(op.kind == "mark" and op.label == "forked" for op in ops[:k]) else 0


def test_crash_state_fork(tmp_path, tiny, stream) -> None:
    root = tmp_path / "root"
    rec = record(str(root), _setup_session(tiny, 3), _fork)
    records, rec_bytes = _records_of(root, "f")
    check = SessionCheck(tiny, "f", records, rec_bytes, stream, others=("s",), whole=True)
    n = len(records) // rec_bytes

    def acked(ops, k: int) -> int:
        return n if _forked(ops, k) else -1

    result = explore("fork", rec, check, budget=BUDGET, acked=acked, strict_rename=True)
    print(f"  opened with the model: {check.opened}")
    _report(result)
    start = CrashPoint(rec.snapshot, rec.ops, len(rec.ops), 4096)
    assert "sessions/f/kv.coli_kv" in start.tree(start.extreme(keep=True))


# -- bundle import -------------------------------------------------------------------------------

def test_crash_state_bundle_import(tmp_path, tiny, stream) -> None:
    import io

    from sessionstore.migration.exporting import export_session
    from sessionstore.migration.migrate import import_bundle

    root = tmp_path / "root"
    bundle = io.BytesIO()

    def setup(where: str) -> None:
        _setup_session(tiny, 3)(where)
        export_session(SessionStore(where), "s", bundle)

    def protocol(where: str, rec: Recorder) -> None:
        import_bundle(SessionStore(where), io.BytesIO(bundle.getvalue()), as_id="b")
        rec.mark("imported", 1)

    rec = record(str(root), setup, protocol)
    records, rec_bytes = _records_of(root, "b")
    check = SessionCheck(tiny, "b", records, rec_bytes, stream, others=("s",), whole=True)
    n = len(records) // rec_bytes

    def acked(ops, k: int) -> int:
        return n if any(op.kind == "mark" and op.label == "imported" for op in ops[:k]) else -1

    result = explore("bundle import", rec, check, budget=BUDGET, acked=acked, strict_rename=True)
    print(f"  opened with the model: {check.opened}")
    _report(result)


def test_crash_state_install_needs_the_tmp_fsync(tmp_path, tiny, stream, monkeypatch) -> None:
    """Without the fsync of ``tmp/`` after a session is renamed out of it (FORMAT.md 5.1), a fork
    acknowledged before a crash can be gone after it when a rename across directories needs both
    fsyncs: the explorer finds it (it did, before ``install_dir`` fsynced ``tmp/``)."""
    from sessionstore.sessions import directory

    real = directory.fsync_directory

    def skip_tmp(path) -> None:
        if os.path.basename(os.fspath(path)) != "tmp":
            real(path)

    root = tmp_path / "root"
    record(str(root), _setup_session(tiny, 3), lambda where, rec: None)  # the session, unrecorded
    monkeypatch.setattr(directory, "fsync_directory", skip_tmp)
    rec = Recorder(root)
    with rec.active():
        _fork(str(root), rec)
    records, rec_bytes = _records_of(root, "f")
    check = SessionCheck(tiny, "f", records, rec_bytes, stream, whole=True)
    n = len(records) // rec_bytes
    result = explore("fork without the tmp fsync", rec, check, budget=50, keep_failures=1,
                     acked=lambda ops, k: n if _forked(ops, k) else -1, strict_rename=True)
    print(result.summary())
    assert result.failures and "gone" in result.failures[0], result.summary()
