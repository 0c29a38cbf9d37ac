"""Every crash state a POSIX file system may leave during the kv file's protocols, checked
(FORMAT.md 3.9; issue 26 part 1).

Each test records one protocol's file-system operations (:class:`tests.support.crash_trace.Recorder`),
then builds the states a crash after each op may leave (un-synced writes dropped, kept, torn at
512 B and 4 KiB, reordered; names not durable before their directory's fsync:
:mod:`tests.support.crash_states`), samples them deterministically (seed 26, the same budget
of distinct states per crash point) and checks each with the library's own open and recovery:
the file reads as a committed prefix of exactly the appended records, holds at least every
record committed before the crash, its sidecar never vouches for a wrong record, and a writer
opens it (recovery), after which the sidecar vouches for every committed record. One state in
500 also goes through ``coli-kv verify`` and ``inspect --json`` (their ``main``, in process).
Run them with ``pytest -k crash_state``.
"""
from __future__ import annotations

import contextlib
import io
import os

import pytest

from kernels.errors import ColiError
from kernels.rows import KV_FORMAT_OF_DTYPE
from sessionstore.kvfile.convert import convert_file
from sessionstore.kvfile.fsio import fsync_parent
from sessionstore.kvfile.header import NREC_OFFSET, Dims, pack_nrec
from sessionstore.kvfile.layout import pack_records
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.sidecar import load_sidecar
from sessionstore.kvfile.sidecar_check import check_records
from sessionstore.kvfile.writer import KVWriter
from tests.support.crash_explore import Exploration, explore, last_ack, record
from tests.support.crash_states import CrashPoint, Tree, final_tree
from tests.support.crash_trace import Recorder
from tests.support.writer import expected_records, gen_f32, gen_fp8

DIMS = Dims(n_layers=4, kv_lora=64, qk_rope=16, index_head_dim=0, n_index_layers=0, vocab=1000)
KV = "kv.coli_kv"
BUDGET = 4000  # distinct states per crash point and sector size


def _report(result: Exploration) -> None:
    print(result.summary())
    assert not result.failures, result.summary() + "\n" + "\n".join(result.failures)


class KVCheck:
    """The checks of one state of a kv file whose records are ``gen(position)`` packed as the
    file's version (``gen_f32`` rows for a v1 file, and for a v2 file upgraded from one)."""

    def __init__(self, *, kv_dtype: str, gen, appended: int, cli_every: int = 0,
                 histories: list[bytes] | None = None) -> None:
        self.kv_dtype = kv_dtype
        self.gen = gen
        self.appended = appended
        self.cli_every = cli_every
        self.checked = 0
        self._expected = {v: [expected_records(v, DIMS, appended, gen=gen)] for v in (1, 2)}
        version, tag = KV_FORMAT_OF_DTYPE[kv_dtype]
        if version == 3:  # the 4-bit tier's rows, through its codec
            self._expected[3] = [pack_records(3, DIMS, gen(DIMS, 0, appended), tag).tobytes()]
        if histories is not None:  # v2 records of each history the file may hold (a truncate)
            self._expected[2] = histories

    def _prefix(self, path: str, committed: int, *, recovered: bool = False) -> int:
        """The records read (checked); ``recovered``: after a writer's recovery, the sidecar must
        vouch for every one of them."""
        with open_kv(path, expect=DIMS) as reader:
            n = reader.nrec
            assert committed <= n <= self.appended, f"{n} records read, committed {committed}, appended {self.appended}"
            rec = reader.record_bytes
            body = bytes(reader.records_bytes_view(0, n)) if n else b""
            assert any(body == h[:n * rec] for h in self._expected[reader.version]), \
                "records differ from the appended ones"
            side = load_sidecar(path)
            assert side is not None or not recovered, "no sidecar after a writer's recovery"
            if side is not None:
                report = check_records(reader, side)
                assert report.sound and not report.mismatched, f"sidecar vouches wrongly: {report}"
                assert not recovered or (report.status == "ok" and report.vouched == n), f"after recovery: {report}"
            return n

    def __call__(self, directory: str, committed: int) -> None:
        path = os.path.join(directory, KV)
        n = self._prefix(path, committed)
        self.checked += 1
        if self.cli_every and self.checked % self.cli_every == 1:
            _cli_accepts(path)
        with KVWriter.open(path, DIMS, kv_dtype=self.kv_dtype, create=False) as w:
            assert w.nrec == n, f"the writer recovered {w.nrec} records, the reader saw {n}"
            w.upgrade()  # a v1 file opened with fp8 stays untouched until then (FORMAT.md 3.2)
            w.close(commit=False)
        assert self._prefix(path, committed, recovered=True) == n


def _cli_accepts(path: str) -> None:
    """``coli-kv verify`` and ``inspect --json`` (in process) accept the state."""
    from tools.coli_kv import main

    for argv in (["verify", path], ["inspect", "--json", path]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(argv)
        assert code == 0, f"coli-kv {' '.join(argv[:-1])} exited {code}: {out.getvalue()[-400:]}"


# -- append + commit, decode-loop commits --------------------------------------------------------

def _setup_fp8(root: str) -> None:
    with KVWriter.open(os.path.join(root, KV), DIMS) as w:
        w.append(gen_fp8(DIMS, 0, 3))


APPENDS = ((3, 5), (8, 9), (17, 40), (57, 3), (60, 24), (84, 64))  # (first position, records) per commit


def _append_commit(root: str, rec: Recorder) -> None:
    """Open; append 5, 9, 40, 3, 24 and 64 records, each followed by a commit (a staging buffer of 16
    records: full chunks are written early, without a barrier, and their write-back started); close."""
    with KVWriter.open(os.path.join(root, KV), DIMS, staging_bytes=16 * 356) as w:
        for start, k in APPENDS:
            w.append(gen_fp8(DIMS, start, k))
            rec.mark("ack", w.commit())


def _decode_loop(root: str, rec: Recorder) -> None:
    """A session's decode loop: write-behind (every record and its sidecar entry written as it
    is appended), zero-filled headroom (default size), one record appended at a time, a commit
    every 2 records, 10 commits."""
    with KVWriter.open(os.path.join(root, KV), DIMS, write_behind=True, preallocate=None) as w:
        for p in range(3, 23):
            w.append(gen_fp8(DIMS, p, 1))
            if p % 2 == 0:
                rec.mark("ack", w.commit())


def _bound(directory: str) -> int:
    """Records the fsynced commit word of the all-dropped state commits (0 if none opens)."""
    try:
        with open_kv(os.path.join(directory, KV)) as reader:
            return reader.nrec
    except (ColiError, OSError):
        return 0


def test_crash_state_append_commit(tmp_path) -> None:
    rec = record(str(tmp_path / "root"), _setup_fp8, _append_commit)
    check = KVCheck(kv_dtype="fp8", gen=gen_fp8, appended=148, cli_every=500)
    _report(explore("append + commit", rec, check, budget=BUDGET, bound=_bound))


def test_crash_state_decode_loop(tmp_path) -> None:
    rec = record(str(tmp_path / "root"), _setup_fp8, _decode_loop)
    check = KVCheck(kv_dtype="fp8", gen=gen_fp8, appended=23, cli_every=500)
    _report(explore("decode-loop commits", rec, check, budget=BUDGET, bound=_bound))


# -- truncate (prefix reuse) and appends over the cut ----------------------------------------

def _truncate(root: str, rec: Recorder) -> None:
    """Append 9 + commit; append 3 (not committed); truncate(10) (it drops 2 committed records:
    the caller gave them up, so the acknowledged count is 10 from the call on); append 6 and 20
    records of other rows (epoch 1) over the cut, each committed."""
    with KVWriter.open(os.path.join(root, KV), DIMS, staging_bytes=16 * 356) as w:
        w.append(gen_fp8(DIMS, 3, 9))
        rec.mark("ack", w.commit())
        w.append(gen_fp8(DIMS, 12, 3))
        rec.mark("ack", 10)
        w.truncate(10)
        for start, k in ((10, 6), (16, 20)):
            w.append(gen_fp8(DIMS, start, k, epoch=1))
            rec.mark("ack", w.commit())


def test_crash_state_truncate(tmp_path) -> None:
    rec = record(str(tmp_path / "root"), _setup_fp8, _truncate)
    old = expected_records(2, DIMS, 15)
    new = old[:10 * 356] + pack_records(2, DIMS, gen_fp8(DIMS, 10, 26, epoch=1)).tobytes()
    check = KVCheck(kv_dtype="fp8", gen=gen_fp8, appended=36, cli_every=500, histories=[old, new])
    _report(explore("truncate + appends", rec, check, budget=BUDGET, acked=last_ack))


# -- recovery on open (3.3), itself crashed --------------------------------------------------------

def _setup_needs_recovery(root: str) -> None:
    """What a crash (or the engine) can leave: nrec 20 in a file cut inside record 15 (15
    complete), a sidecar whose count (18) ran ahead, stale create and upgrade temps."""
    path = os.path.join(root, KV)
    with KVWriter.open(path, DIMS) as w:
        w.append(gen_fp8(DIMS, 0, 18))
    with open(path, "r+b") as f:
        f.seek(NREC_OFFSET)
        f.write(pack_nrec(20))
        f.truncate(40 + 15 * 356 + 100)
    for temp in (".create.tmp", ".upgrade.tmp", ".upgrade.tmp.colisum"):
        with open(path + temp, "wb") as f:
            f.write(b"stale temp")


def _recover_then_commit(root: str, rec: Recorder) -> None:
    """A writer's open recovers (temps removed, nrec cut back to 15, the sidecar's count cut
    back); then 3 records of other rows (epoch 1: the sidecar still has the old ones' entries
    past its count) appended and committed."""
    with KVWriter.open(os.path.join(root, KV), DIMS) as w:
        rec.mark("ack", w.nrec)
        w.append(gen_fp8(DIMS, 15, 3, epoch=1))
        rec.mark("ack", w.commit())


def test_crash_state_recovery(tmp_path) -> None:
    rec = record(str(tmp_path / "root"), _setup_needs_recovery, _recover_then_commit)
    old = expected_records(2, DIMS, 15)
    new = old + pack_records(2, DIMS, gen_fp8(DIMS, 15, 3, epoch=1)).tobytes()
    check = KVCheck(kv_dtype="fp8", gen=gen_fp8, appended=18, cli_every=500, histories=[new])
    _report(explore("recovery on open + commit", rec, check, budget=BUDGET, bound=_bound))


# -- v1 -> v2 upgrade ----------------------------------------------------------------------------

def _setup_v1(root: str) -> None:
    with KVWriter.open(os.path.join(root, KV), DIMS, kv_dtype="f32") as w:
        w.append(gen_f32(DIMS, 0, 6))


def _upgrade(root: str, rec: Recorder, kv_dtype: str = "fp8") -> None:
    """A v1 file of 6 records opened with fp8 (or the 4-bit tier) on: the first append rewrites
    it as v2 (v3) (FORMAT.md 3.7); then appends of 3, 2, 24 and 40 records, each committed."""
    with KVWriter.open(os.path.join(root, KV), DIMS, kv_dtype=kv_dtype) as w:
        for start, k in ((6, 3), (9, 2), (11, 24), (35, 40)):
            w.append(gen_f32(DIMS, start, k))
            rec.mark("ack", w.commit())


@pytest.mark.parametrize("kv_dtype, budget", [("fp8", BUDGET), ("int4", BUDGET // 4)])
def test_crash_state_upgrade(tmp_path, kv_dtype: str, budget: int) -> None:
    rec = record(str(tmp_path / "root"), _setup_v1, lambda root, r: _upgrade(root, r, kv_dtype))
    check = KVCheck(kv_dtype=kv_dtype, gen=gen_f32, appended=75, cli_every=500)
    target = "v2" if kv_dtype == "fp8" else f"v3 {kv_dtype}"
    _report(explore(f"v1 -> {target} upgrade", rec, check, budget=budget, bound=_bound))


# -- convert -------------------------------------------------------------------------------------

SRC, DST = "src.coli_kv", "dst.coli_kv"


def _setup_convert(root: str) -> None:
    with KVWriter.open(os.path.join(root, SRC), DIMS) as w:
        w.append(gen_fp8(DIMS, 0, 7))
    _setup_v1_dst(root)


def _setup_v1_dst(root: str) -> None:
    """An older DST (3 records of other rows) with its sidecar: ``--force`` replaces it."""
    with KVWriter.open(os.path.join(root, DST), DIMS, kv_dtype="f32") as w:
        w.append(gen_f32(DIMS, 0, 3, epoch=1))


def _convert(root: str, rec: Recorder) -> None:
    """``convert SRC DST --to v1 --force`` over an existing DST, then ``--to v2`` to a new DST2."""
    convert_file(os.path.join(root, SRC), os.path.join(root, DST), 1, force=True)
    rec.mark("converted", 1)
    convert_file(os.path.join(root, SRC), os.path.join(root, DST + "2"), 2)
    rec.mark("converted", 2)


class ConvertCheck:
    """SRC untouched; DST the old file or exactly the converted one; DST2 absent or exactly
    SRC's bytes; sidecars never vouch wrongly; the convert runs again and gives the same bytes."""

    def __init__(self, root: str, before: Tree) -> None:
        self.src = _read(os.path.join(root, SRC))
        old = before[DST]
        assert old is not None
        self.old_dst = old
        self.new_dst = _read(os.path.join(root, DST))
        self.dst2 = _read(os.path.join(root, DST + "2"))

    def __call__(self, directory: str, done: int) -> None:
        src, dst, dst2 = (os.path.join(directory, n) for n in (SRC, DST, DST + "2"))
        assert _read(src) == self.src, "SRC changed"
        found = _read(dst)
        assert found in (self.old_dst, self.new_dst), "DST is neither the old file nor the converted one"
        assert done < 1 or found == self.new_dst, "DST lost the acknowledged conversion"
        found2 = _read(dst2) if os.path.lexists(dst2) else None
        assert found2 in (None, self.dst2), "DST2 is a partial conversion"
        assert done < 2 or found2 == self.dst2, "DST2 lost the acknowledged conversion"
        for path in (dst, dst2):
            if os.path.lexists(path):
                with open_kv(path) as reader:
                    side = load_sidecar(path)
                    if side is not None:
                        report = check_records(reader, side)
                        assert report.sound and not report.mismatched, f"{path}: {report}"
        convert_file(src, dst, 1, force=True)
        assert _read(dst) == self.new_dst


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _done(ops, k: int) -> int:
    marks = [op.value for op in ops[:k] if op.kind == "mark" and op.label == "converted"]
    return marks[-1] if marks else 0


def test_crash_state_convert(tmp_path) -> None:
    rec = record(str(tmp_path / "root"), _setup_convert, _convert)
    start = CrashPoint(rec.snapshot, rec.ops, 0, 4096)
    check = ConvertCheck(str(tmp_path / "root"), start.tree(start.extreme(keep=False)))
    _report(explore("convert", rec, check, budget=BUDGET, acked=_done))


# -- the checker is not vacuous ------------------------------------------------------------------

class _WordFirstWriter(KVWriter):
    """A broken commit: the commit word is written BEFORE the data barrier (3.4 steps 4 before 3)."""

    def commit(self, *, beside=None) -> int:
        if self.length != self.nrec:  # something to commit: its word first, then the real commit's steps
            fd = os.open(self.path, os.O_WRONLY)  # a descriptor of its own: the recorder sees the write all the same
            try:
                os.pwrite(fd, pack_nrec(self.length), NREC_OFFSET)
            finally:
                os.close(fd)
        return super().commit(beside=beside)


def _broken_append_commit(root: str, rec: Recorder) -> None:
    with _WordFirstWriter.open(os.path.join(root, KV), DIMS) as w:
        w.append(gen_fp8(DIMS, 3, 5))
        rec.mark("ack", w.commit())


def test_crash_state_checker_catches_word_before_barrier(tmp_path) -> None:
    rec = record(str(tmp_path / "root"), _setup_fp8, _broken_append_commit)
    check = KVCheck(kv_dtype="fp8", gen=gen_fp8, appended=8)
    result = explore("broken commit", rec, check, budget=BUDGET, bound=_bound, keep_failures=1)
    print(result.summary())
    assert result.failures, f"the checker missed a commit word written before its data barrier: {result.summary()}"
    assert "records differ" in result.failures[0] or "sidecar" in result.failures[0], result.failures[0]


def _replace(root: str, rec: Recorder, *, dir_fsync: bool) -> None:
    """A whole-file replace: temp, fsync, rename, then (only with ``dir_fsync``) the directory
    fsync, then acknowledged."""
    tmp, path = os.path.join(root, "new.tmp"), os.path.join(root, KV)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"new bytes")
    os.fsync(fd)
    os.close(fd)
    os.replace(tmp, path)
    if dir_fsync:
        fsync_parent(path)
    rec.mark("ack", 1)


@pytest.mark.parametrize("dir_fsync", [False, True])
def test_crash_state_checker_catches_rename_without_dir_fsync(tmp_path, dir_fsync: bool) -> None:
    """Without the directory fsync an acknowledged replace can be lost; with it, never."""
    def setup(root: str) -> None:
        with open(os.path.join(root, KV), "wb") as f:
            f.write(b"old bytes")

    def check(directory: str, acked: int) -> None:
        found = _read(os.path.join(directory, KV))
        assert found == b"new bytes" if acked else found in (b"old bytes", b"new bytes"), found

    rec = record(str(tmp_path / "root"), setup, lambda root, r: _replace(root, r, dir_fsync=dir_fsync))
    result = explore("replace", rec, check, budget=BUDGET, keep_failures=1)
    print(result.summary())
    assert bool(result.failures) != dir_fsync, result.summary() + "\n" + "\n".join(result.failures)


# -- the real command line on a sample -------------------------------------------------------------

def test_crash_state_cli_sample(tmp_path) -> None:
    """``coli-kv verify`` and ``inspect --json`` as processes (``python -m tools``, this tree) on
    3 states of append + commit's crash point with the most choices, at 512 B sectors: everything
    pending dropped, everything kept, and the first with one choice flipped."""
    import json
    import random
    import subprocess
    import sys

    from tests.support.crash_states import materialize, states

    rec = record(str(tmp_path / "root"), _setup_fp8, _append_commit)
    k = max(range(len(rec.ops) + 1), key=lambda i: CrashPoint(rec.snapshot, rec.ops, i, 512).units())
    point = CrashPoint(rec.snapshot, rec.ops, k, 512)
    committed = max(last_ack(rec.ops, k), _bound_of(point.tree(point.extreme(keep=False)), tmp_path))
    trees = list(states(point, random.Random(26), 3, set()))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for i, tree in enumerate(trees):
        where = str(tmp_path / f"state{i}")
        materialize(tree, where)
        path = os.path.join(where, KV)
        for argv in (["verify", path], ["inspect", "--json", path]):
            proc = subprocess.run([sys.executable, "-m", "tools", *argv], cwd=repo, capture_output=True,
                                  text=True, timeout=120, env={**os.environ, "COLI_LOG": "off"})
            assert proc.returncode == 0, f"coli-kv {argv[0]} exited {proc.returncode}: {proc.stderr[-400:]}"
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        assert found["nrec"] >= committed, (found["nrec"], committed)
    print(f"cli sample: {len(trees)} states of crash point {k} through coli-kv verify and inspect")
    assert len(trees) == 3


def _bound_of(tree: Tree, tmp_path) -> int:
    from tests.support.crash_states import materialize

    where = str(tmp_path / "low")
    materialize(tree, where)
    return _bound(where)


def test_crash_state_recorder_misses_nothing_silently(tmp_path) -> None:
    """A write that goes around the recorded calls (a builtin ``open().write``) fails the replay
    check, and so does a name made that way; recorded ones replay exactly."""
    rec = Recorder(tmp_path)
    with rec.active():
        fd = os.open(tmp_path / "seen", os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(fd, b"recorded", 0)
        os.close(fd)
    rec.check_replay(final_tree)
    with rec.active():
        with open(tmp_path / "seen", "r+b") as f:
            f.write(b"RECORDED")
    with pytest.raises(AssertionError, match="did not see written"):
        rec.check_replay(final_tree)
    with rec.active():
        with open(tmp_path / "unseen", "wb") as f:
            f.write(b"x")
    with pytest.raises(AssertionError, match="names the recorder did not see"):
        rec.check_replay(final_tree)
