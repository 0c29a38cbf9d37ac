"""Regression tests from the QA pass: bad sampler settings never reach the manifest, a corrupt
committed record is named on resume, and a store root that is a regular file is refused."""
from __future__ import annotations

import json

import pytest

from kernels.errors import CorruptionError, FormatError
from kernels.model.sampling import Sampler
from sessionstore.kvfile.reader import open_kv
from sessionstore.sessions import SessionOptions
from sessionstore.sessions.manifest import MANIFEST_NAME, read_manifest
from sessionstore.sessions.store import SessionStore
from tools.coli_kv import main

PROMPT = list(b"The quick brown fox")


def test_bad_sampler_is_refused_before_the_manifest_changes(tmp_path) -> None:
    store = SessionStore(tmp_path)
    s = store.create("s", "tiny", kv_dtype="fp8", sampler=Sampler(0.8, 10, 0.9, 3))
    s.generate(PROMPT, 3)
    before = (store.session_dir("s") / MANIFEST_NAME).read_bytes()
    for bad in ({"seed": -1}, {"temperature": float("nan")}, {"top_p": 2.0}, {"top_k": -3},
                {"seed": 1 << 64}):
        with pytest.raises(FormatError, match="sampling"):
            s.generate(None, 2, sampler=Sampler(**{"temperature": 0.5, **bad}))
    assert (store.session_dir("s") / MANIFEST_NAME).read_bytes() == before
    assert len(s.generate(None, 2).tokens) == 2  # the session still works
    s.close()
    assert read_manifest(store.session_dir("s") / MANIFEST_NAME).sampler == Sampler(0.8, 10, 0.9, 3)


def test_an_already_bad_manifest_gives_one_clear_error(tmp_path, capsys) -> None:
    store = SessionStore(tmp_path)
    store.create("s", "tiny", kv_dtype="fp8").close()
    path = store.session_dir("s") / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["sampler"]["top_p"] = 7.5  # written by an older, unvalidated version
    path.write_text(json.dumps(data))
    with pytest.raises(FormatError, match=r"manifest\.json: field 'sampler': sampling: top_p"):
        SessionStore(tmp_path).open("s")
    rc = main(["generate", "--root", str(tmp_path), "--session", "s", "--prompt-ids", "1", "--max-new", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "top_p" in err[0] and "Traceback" not in err[0]


def test_resume_names_the_session_file_and_the_corrupt_record(tmp_path) -> None:
    store = SessionStore(tmp_path)
    s = store.create("chat-1", "tiny", kv_dtype="fp8", options=SessionOptions(commit_every=64))
    s.generate(PROMPT, 6)
    s.close()
    kv = store.kv_path("chat-1")
    n = read_manifest(store.session_dir("chat-1") / MANIFEST_NAME).committed
    with open_kv(kv) as reader:
        rec = reader.record_bytes
    bad = 3  # a middle record: not one of the two ends resume checks cheaply
    assert 0 < bad < n - 1
    raw = bytearray(kv.read_bytes())
    start = 40 + bad * rec
    raw[start + 4: start + rec - 8] = bytes(rec - 12)  # its rows zeroed, its token kept
    kv.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError) as info:
        SessionStore(tmp_path).open("chat-1")
    msg = str(info.value)
    assert "'chat-1'" in msg and str(kv) in msg
    assert f"record at position {bad} (byte {start}) fails its checksum" in msg
    # without the sidecar the error still names the session and the file
    (store.session_dir("chat-1") / "kv.coli_kv.colisum").unlink()
    with pytest.raises(CorruptionError) as info:
        SessionStore(tmp_path).open("chat-1")
    assert "'chat-1'" in str(info.value) and str(kv) in str(info.value)
    assert "checksum" not in str(info.value)


def test_root_that_is_a_file_is_one_line_in_the_cli(tmp_path, capsys) -> None:
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    for argv in (["ls", "--root", str(f)],
                 ["generate", "--root", str(f), "--session", "s", "--model", "tiny",
                  "--prompt-ids", "1", "--max-new", "1"]):
        assert main(argv) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{f} is not a directory" in err[0] and "Errno" not in err[0]
