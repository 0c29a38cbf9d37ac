"""Integrity on read: rows a sidecar condemns are never computed from or moved; import installs
only what `verify` calls sound. Every refusal leaves the session's files exactly as found."""
from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from kernels.errors import CorruptionError
from sessionstore.kvfile.convert import convert_file
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.verify import verify_file
from sessionstore.migration import export_session, migrate
from sessionstore.sessions.slots import export_slot
from sessionstore.sessions.store import SessionStore
from tests.support.migrate import make_session, tree_state
from tests.support.session_util import write_tiny_checkpoint
from tools.coli_kv import main

PROMPT = "72,105,33"
SID = "keep"


def _chat(root: Path, capsys: pytest.CaptureFixture[str]) -> int:
    """A fp8 session of the tiny model with ~51 committed records (through the CLI)."""
    assert main(["generate", "--root", str(root), "--session", SID, "--model", "tiny",
                 "--prompt-ids", PROMPT, "--max-new", "49", "--kv", "fp8", "--json"]) == 0
    capsys.readouterr()
    with open_kv(root / "sessions" / SID / "kv.coli_kv") as reader:
        return reader.record_bytes


def _kv(root: Path) -> Path:
    return root / "sessions" / SID / "kv.coli_kv"


def _session_files(root: Path) -> dict[str, bytes | str]:
    """Every file of the session but its lock file (not data: it holds the last holder's pid)."""
    state = tree_state(root / "sessions" / SID)
    state.pop("kv.coli_kv.lock", None)
    return state


def _xor(path: Path, offset: int, mask: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= mask
    path.write_bytes(bytes(raw))


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_the_reported_bit_flip_is_refused_by_generate(tmp_path, capsys) -> None:
    root = tmp_path / "R"
    rec = _chat(root, capsys)
    kv = _kv(root)
    _xor(kv, 40 + 18 * rec + 73, 0x01)  # inside record 18, like the report's byte 4937
    before = _session_files(root)
    rc = main(["generate", "--root", str(root), "--session", SID, "--max-new", "6", "--json"])
    captured = capsys.readouterr()
    assert rc != 0
    line = _one_line(captured.err)
    assert f"'{SID}'" in line and str(kv) in line
    assert f"record at position 18 (byte {40 + 18 * rec})" in line
    assert _session_files(root) == before  # the sidecar was not extended over record 18
    assert main(["verify", str(kv)]) != 0  # verify still reports the damage
    assert "record" in capsys.readouterr().out + capsys.readouterr().err


@pytest.mark.parametrize("position", [1, 9, 18, 33, 47])
@pytest.mark.parametrize("mask", [0x01, 0x10, 0x80, 0xFF])
def test_any_flipped_middle_record_is_refused(tmp_path, capsys, position, mask) -> None:
    root = tmp_path / "R"
    rec = _chat(root, capsys)
    kv = _kv(root)
    offset = 40 + position * rec + (position * 131 + mask) % rec
    _xor(kv, offset, mask)
    before = _session_files(root)
    with pytest.raises(CorruptionError) as info:
        SessionStore(root).open(SID)
    assert f"record at position {position} (byte {40 + position * rec})" in str(info.value)
    assert _session_files(root) == before
    assert not verify_file(kv).sound


def test_swapped_records_are_refused(tmp_path, capsys) -> None:
    root = tmp_path / "R"
    rec = _chat(root, capsys)
    kv = _kv(root)
    raw = bytearray(kv.read_bytes())
    a, b = 40 + 10 * rec, 40 + 20 * rec
    raw[a:a + rec], raw[b:b + rec] = raw[b:b + rec], raw[a:a + rec]
    kv.write_bytes(bytes(raw))
    before = _session_files(root)
    with pytest.raises(CorruptionError, match=r"record at position 10 \(byte"):
        SessionStore(root).open(SID)
    assert _session_files(root) == before
    assert not verify_file(kv).sound


def test_cut_short_sidecar_is_refused(tmp_path, capsys) -> None:
    root = tmp_path / "R"
    _chat(root, capsys)
    side = Path(str(_kv(root)) + ".colisum")
    os.truncate(side, 64 + 8 * 20)  # entries for records 0..19 only
    before = _session_files(root)
    with pytest.raises(CorruptionError, match="vouches for 20 record"):
        SessionStore(root).open(SID)
    assert _session_files(root) == before


def test_rewound_sidecar_is_refused(tmp_path, capsys) -> None:
    root = tmp_path / "R"
    assert main(["generate", "--root", str(root), "--session", SID, "--model", "tiny",
                 "--prompt-ids", PROMPT, "--max-new", "10", "--kv", "fp8"]) == 0
    side = Path(str(_kv(root)) + ".colisum")
    old = side.read_bytes()  # vouches for the first turn only
    assert main(["generate", "--root", str(root), "--session", SID, "--max-new", "20"]) == 0
    capsys.readouterr()
    side.write_bytes(old)
    before = _session_files(root)
    rc = main(["generate", "--root", str(root), "--session", SID, "--max-new", "3"])
    line = _one_line(capsys.readouterr().err)
    assert rc != 0 and "rewound or cut short" in line and f"'{SID}'" in line
    assert _session_files(root) == before


def test_damaged_sidecar_header_is_refused(tmp_path, capsys) -> None:
    root = tmp_path / "R"
    _chat(root, capsys)
    side = Path(str(_kv(root)) + ".colisum")
    _xor(side, 20, 0x04)  # inside the static hash: the header check fails
    before = _session_files(root)
    with pytest.raises(CorruptionError, match="sidecar"):
        SessionStore(root).open(SID)
    assert _session_files(root) == before


def test_without_a_sidecar_the_tolerance_path_says_so(tmp_path, capsys) -> None:
    root = tmp_path / "R"
    _chat(root, capsys)
    Path(str(_kv(root)) + ".colisum").unlink()
    s = SessionStore(root).open(SID)
    try:
        report = s.resume_report
        assert report["not_covered"] == s.committed > 0
        assert "not covered by a sidecar" in report["verified"]
    finally:
        s.close()


def test_a_sound_resume_checks_every_record(tmp_path, capsys) -> None:
    root = tmp_path / "R"
    _chat(root, capsys)
    s = SessionStore(root).open(SID)
    try:
        assert s.resume_report["not_covered"] == 0
        assert s.resume_report["checksums"] == f"{s.committed} record(s) match their checksums"
        assert s.resume_report["verified"] == "bit-identical"
    finally:
        s.close()


def test_fork_export_export_slot_and_convert_refuse_a_condemned_record(tmp_path, capsys) -> None:
    root = tmp_path / "R"
    rec = _chat(root, capsys)
    kv = _kv(root)
    _xor(kv, 40 + 18 * rec + 5, 0x20)
    store = SessionStore(root)
    before = tree_state(root)
    with pytest.raises(CorruptionError):
        store.fork(SID, "copy")
    sink = io.BytesIO()
    with pytest.raises(CorruptionError, match="record 18"):
        export_session(store, SID, sink)
    model_dir = write_tiny_checkpoint(tmp_path / "model")
    with pytest.raises(CorruptionError, match="record at position 18"):
        export_slot(store, SID, model_dir, force=True)
    assert not any(p.name.startswith(".coli_kv") for p in model_dir.iterdir())
    dst = tmp_path / "out.coli_kv"
    with pytest.raises(CorruptionError, match="refusing to convert"):
        convert_file(kv, dst, "v1")
    assert not dst.exists() and not Path(str(dst) + ".tmp").exists()
    assert tree_state(root) == before
    # the same through the command line: one line each, non-zero
    for argv in (["fork", "--root", str(root), SID, "copy"],
                 ["export", "--root", str(root), SID, str(tmp_path / "b.colib")],
                 ["export-slot", "--root", str(root), SID, str(model_dir), "--force"],
                 ["convert", str(kv), str(dst), "--to", "v1"]):
        assert main(argv) != 0, argv
        _one_line(capsys.readouterr().err)
    assert tree_state(root) == before and not (tmp_path / "b.colib").exists()


def test_export_refuses_a_rewound_sidecar(tmp_path, capsys) -> None:
    root = tmp_path / "R"
    _chat(root, capsys)
    os.truncate(Path(str(_kv(root)) + ".colisum"), 64 + 8 * 7)
    with pytest.raises(CorruptionError, match="rewound or cut short"):
        export_session(SessionStore(root), SID, io.BytesIO())


def _bundle_with_token(tmp_path: Path, token: int) -> bytes:
    """A bundle (checksums sealed over the changed bytes) whose record 5 has input ``token``."""
    src = SessionStore(tmp_path / "src")
    make_session(src, "bad", 9)
    side = src.session_dir("bad") / "kv.coli_kv.colisum"
    side.unlink()  # no sidecar: the bundle is sealed over whatever the file holds
    kv = src.kv_path("bad")
    with open_kv(kv) as reader:
        rec = reader.record_bytes
    raw = bytearray(kv.read_bytes())
    raw[40 + 5 * rec: 40 + 5 * rec + 4] = int(token).to_bytes(4, "little", signed=True)
    kv.write_bytes(bytes(raw))
    sink = io.BytesIO()
    export_session(src, "bad", sink)
    return sink.getvalue()


def test_import_refuses_an_out_of_vocabulary_token(tmp_path, capsys) -> None:
    data = _bundle_with_token(tmp_path, 999_999)
    dst = SessionStore(tmp_path / "dst")
    before = tree_state(dst.root)
    with pytest.raises(CorruptionError, match="999999"):
        migrate.import_bundle(dst, io.BytesIO(data))
    assert tree_state(dst.root) == before
    bundle = tmp_path / "bad.colib"
    bundle.write_bytes(data)
    rc = main(["import", "--root", str(dst.root), str(bundle)])
    line = _one_line(capsys.readouterr().err)
    assert rc != 0 and "outside [0, 1000)" in line
    assert tree_state(dst.root) == before
    negative = _bundle_with_token(tmp_path / "neg", -3)
    with pytest.raises(CorruptionError, match="-3"):
        migrate.import_bundle(dst, io.BytesIO(negative))
    assert tree_state(dst.root) == before


def test_import_of_a_sound_bundle_still_installs(tmp_path) -> None:
    data = _bundle_with_token(tmp_path, 999)
    dst = SessionStore(tmp_path / "dst")
    info = migrate.import_bundle(dst, io.BytesIO(data))
    assert info.tokens == 9
    assert verify_file(dst.kv_path("bad")).sound


def test_resume_report_is_json(tmp_path, capsys) -> None:
    root = tmp_path / "R"
    _chat(root, capsys)
    s = SessionStore(root).open(SID)
    try:
        json.dumps(s.resume_report)
    finally:
        s.close()
    shutil.rmtree(root)


def test_a_real_process_with_default_logging_prints_one_line(tmp_path) -> None:
    """What a user sees: the refused resume is one stderr line (no log line beside it)."""
    import subprocess
    import sys

    from tests.support.session_util import REPO

    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_LOG")}
    root = tmp_path / "R"

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tools.coli_kv", *argv], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    made = cli("generate", "--root", str(root), "--session", SID, "--model", "tiny",
               "--prompt-ids", PROMPT, "--max-new", "49", "--kv", "fp8")
    assert made.returncode == 0, made.stderr
    with open_kv(_kv(root)) as reader:
        rec = reader.record_bytes
    _xor(_kv(root), 40 + 18 * rec + 73, 0x01)
    before = _session_files(root)
    for argv in (("generate", "--root", str(root), "--session", SID, "--max-new", "6"),
                 ("fork", "--root", str(root), SID, "copy"),
                 ("export", "--root", str(root), SID, str(tmp_path / "b.colib"))):
        proc = cli(*argv)
        assert proc.returncode == 3, (argv, proc.stderr)
        assert "18" in _one_line(proc.stderr), argv
    assert _session_files(root) == before
