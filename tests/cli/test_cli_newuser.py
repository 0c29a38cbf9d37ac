"""A new user's mistakes and hostile inputs: one error line, a non-zero exit, nothing left behind.

Regressions found by walking the README on a fresh clone: an invalid sampler flag bricked an
existing session (the manifest stored seed -1), a refused first turn left an empty session and
an empty store skeleton, ``--prompt-ids "1 2"`` became token 12, ``ls`` hid unreadable sessions,
``verify`` said nothing on stderr for a corrupt file, ``convert`` gave a corrupt file a fresh
sidecar vouching for the damage, ``--chunk-mib inf`` raised a traceback.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cuda.device import cuda_status
from sessionstore.sessions.store import SessionStore
from tests.house.test_imports import SERVICE_EXTRAS
from tests.support.extras import without_modules
from tests.support.migrate import S3_BUCKET, s3_endpoint  # noqa: F401 - a fixture
from tools.coli_kv import main

REPO = Path(__file__).resolve().parents[2]
RECORD_BYTES = 268  # the tiny model's fp8 record: 4 + 3 layers x (64 + 4 + 16 + 4)


def _session(root: Path, sid: str = "s", *extra: str) -> None:
    assert main(["generate", "--root", str(root), "--session", sid, "--model", "tiny", "--prompt-ids",
                 "72,105,33", "--max-new", "4", *extra]) == 0


def _one_error(capsys: pytest.CaptureFixture[str], rc: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1, (rc, err)
    assert err[0].startswith("coli-kv ") and "Traceback" not in err[0]
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    return err[0]


def _corrupt_copy(root: Path, dst: Path) -> Path:
    """The session's kv file and sidecar copied to ``dst``, one byte of record 1 flipped."""
    kv = SessionStore(root).kv_path("s")
    shutil.copyfile(kv, dst)
    shutil.copyfile(str(kv) + ".colisum", str(dst) + ".colisum")
    with open(dst, "r+b") as f:
        f.seek(40 + RECORD_BYTES + 30)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return dst


def test_verify_unsound_is_one_stderr_line_and_json_still_last(tmp_path, capsys) -> None:
    _session(tmp_path)
    bad = _corrupt_copy(tmp_path, tmp_path / "bad.coli_kv")
    capsys.readouterr()
    rc = main(["verify", str(bad), "--json"])
    out, err = capsys.readouterr()
    assert rc == 3 and json.loads(out.strip().splitlines()[-1])["sound"] is False
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "UNSOUND" in lines[0] and str(bad) in lines[0] and "byte" in lines[0]


def test_convert_refuses_an_unsound_source_unless_asked(tmp_path, capsys) -> None:
    _session(tmp_path)
    bad = _corrupt_copy(tmp_path, tmp_path / "bad.coli_kv")
    dst = tmp_path / "copy.coli_kv"
    capsys.readouterr()
    _one_error(capsys, main(["convert", str(bad), str(dst), "--to", "v1"]), "UNSOUND", "--unverified")
    assert not dst.exists() and not Path(str(dst) + ".colisum").exists()
    assert main(["convert", str(bad), str(dst), "--to", "v1", "--unverified"]) == 0
    assert dst.exists()
    # the sound session file still converts without any flag
    assert main(["convert", str(SessionStore(tmp_path).kv_path("s")), str(tmp_path / "ok.coli_kv"),
                 "--to", "v1"]) == 0


@pytest.mark.parametrize("ids", ["1 2", "1_0", "\u0661", "+-1", "0x10"])
def test_prompt_ids_are_ascii_integers_on_both_paths(tmp_path, capsys, ids) -> None:
    rc = main(["generate", "--model", "tiny", "--prompt-ids", ids, "--max-new", "1"])
    _one_error(capsys, rc, "--prompt-ids")
    rc = main(["generate", "--root", str(tmp_path / "r"), "--session", "s", "--model", "tiny",
               "--prompt-ids", ids, "--max-new", "1"])
    _one_error(capsys, rc, "--prompt-ids")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flags,needle", [
    (["--seed", "-1"], "seed"),
    (["--temperature", "nan"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--top-k", "-3"], "top_k"),
])
def test_bad_sampler_flag_never_bricks_an_existing_session(tmp_path, capsys, flags, needle) -> None:
    _session(tmp_path, "s", "--temperature", "0.7", "--seed", "5")
    before = SessionStore(tmp_path).read_manifest("s")
    capsys.readouterr()
    rc = main(["generate", "--root", str(tmp_path), "--session", "s", "--max-new", "1", *flags])
    _one_error(capsys, rc, needle)
    after = SessionStore(tmp_path).read_manifest("s")  # still readable, unchanged
    assert after.sampler == before.sampler and after.committed == before.committed
    assert main(["generate", "--root", str(tmp_path), "--session", "s", "--max-new", "1"]) == 0


def test_explicit_greedy_flag_overrides_a_sampling_session(tmp_path, capsys) -> None:
    _session(tmp_path, "s", "--temperature", "0.9", "--seed", "3")
    assert SessionStore(tmp_path).read_manifest("s").sampler.temperature == pytest.approx(0.9)
    assert main(["generate", "--root", str(tmp_path), "--session", "s", "--max-new", "1"]) == 0
    assert SessionStore(tmp_path).read_manifest("s").sampler.temperature == pytest.approx(0.9)
    assert main(["generate", "--root", str(tmp_path), "--session", "s", "--max-new", "1",
                 "--temperature", "0"]) == 0
    sampler = SessionStore(tmp_path).read_manifest("s").sampler
    assert sampler.temperature == 0.0 and sampler.seed == 3


@pytest.mark.parametrize("flags,needle", [
    (["--prompt-ids", "300"], "vocabulary"),
    (["--prompt-ids", "1", "--max-new", "-1"], "max_new"),
    (["--prompt-ids", "1", "--max-new", "5000"], "context"),
    (["--prompt-ids", "1", "--commit-every", "-5"], "--commit-every"),
    (["--prompt-ids", "1", "--temperature", "-1"], "temperature"),
])
def test_refused_first_turn_leaves_no_session_and_no_store(tmp_path, capsys, flags, needle) -> None:
    root = tmp_path / "fresh"
    rc = main(["generate", "--root", str(root), "--session", "new", "--model", "tiny", *flags])
    _one_error(capsys, rc, needle)
    assert not root.exists()
    # in an existing store only the refused session is missing afterwards
    _session(root, "keep")
    capsys.readouterr()
    rc = main(["generate", "--root", str(root), "--session", "new", "--model", "tiny", *flags])
    _one_error(capsys, rc, needle)
    assert SessionStore(root).directory.ids() == ["keep"]


def test_ls_lists_unreadable_sessions(tmp_path, capsys) -> None:
    _session(tmp_path, "good")
    _session(tmp_path, "broken")
    (tmp_path / "sessions" / "broken" / "manifest.json").write_text("{garbage")
    capsys.readouterr()
    assert main(["ls", "--root", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "good" in table and "broken" in table and "UNREADABLE" in table
    assert main(["ls", "--root", str(tmp_path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s["id"] for s in listing["sessions"]] == ["good"]
    assert [u["id"] for u in listing["unreadable"]] == ["broken"]
    assert "not valid JSON" in listing["unreadable"][0]["error"]


def test_cuda_backend_is_one_line_with_a_hint_or_works(tmp_path, capsys) -> None:
    usable, _ = cuda_status()
    argv = ["generate", "--model", "tiny", "--prompt-ids", "1", "--max-new", "1", "--backend", "cuda"]
    session = ["--root", str(tmp_path / "r"), "--session", "s"]
    if usable:
        assert main(argv) == 0 and main(argv + session) == 0
        return
    _one_error(capsys, main(argv), "CUDA", "--backend cpu")
    _one_error(capsys, main(argv + session), "CUDA", "--backend cpu")
    assert not (tmp_path / "r").exists()


def test_serve_once_reports_failed_bundles(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLI_LOG", "off")
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "junk.colibundle").write_bytes(b"not a bundle")
    rc = main(["serve", "--root", str(tmp_path / "dst"), "--inbox", str(inbox), "--once", "--json"])
    out, err = capsys.readouterr()
    assert rc == 1 and json.loads(out.strip().splitlines()[-1])["failed"] == 1
    assert len(err.strip().splitlines()) == 1 and "junk.colibundle" in err
    assert (inbox / "failed" / "junk.colibundle").exists()
    rc = main(["serve", "--root", str(tmp_path / "other"), "--inbox", str(tmp_path / "nope"), "--once"])
    _one_error(capsys, rc, "inbox")
    assert not (tmp_path / "other").exists()


def test_remote_reads_and_failed_pulls_create_no_store(tmp_path, capsys, s3_endpoint) -> None:
    root = tmp_path / "r"
    _one_error(capsys, main(["lease", "--root", str(root), "--remote", ""]), "no remote")
    remote = f"s3://{S3_BUCKET}/newuser"
    assert main(["lease", "--root", str(root), "--remote", remote]) == 0
    assert capsys.readouterr().out.strip() == f"no leases on {remote}"
    assert main(["lease", "--root", str(root), "ghost", "--remote", remote, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"leases": []}
    assert not root.exists()  # leases live on the remote: listing them creates no local store
    _one_error(capsys, main(["pull", "--root", str(root), "ghost", "--remote", remote]), "ghost")
    assert not root.exists()


def test_real_process_failures_are_one_line(tmp_path) -> None:
    """As a user runs it: default logging, a real process, no traceback, one line, non-zero."""
    root = tmp_path / "store"
    env = {k: v for k, v in os.environ.items() if k != "COLI_LOG"}

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tools", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env=env, check=False)

    assert cli("generate", "--root", str(root), "--session", "s", "--model", "tiny", "--prompt-ids",
               "1,2,3", "--max-new", "3").returncode == 0
    bad = _corrupt_copy(root, tmp_path / "bad.coli_kv")
    for argv, code in [
        (["verify", str(bad)], 3),
        (["convert", str(bad), str(tmp_path / "c.coli_kv"), "--to", "v2"], 3),
        (["generate", "--root", str(root), "--session", "s", "--seed", "-1", "--max-new", "1"], 2),
        (["generate", "--root", str(root), "--session", "s", "--temperature", "nan", "--max-new", "1"], 2),
        (["generate", "--root", str(root), "--session", "n", "--model", "tiny", "--prompt-ids", "999"], 2),
    ]:
        proc = cli(*argv)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == code and len(err) == 1 and "Traceback" not in proc.stderr, (argv, proc)
    assert SessionStore(root).directory.ids() == ["s"]
    assert cli("generate", "--root", str(root), "--session", "s", "--max-new", "1").returncode == 0
    # an argument type error is argparse's usage message: never a traceback
    for value in ("inf", "nan", "abc", "0"):
        proc = cli("export", "--root", str(root), "s", str(tmp_path / "b.colib"), "--chunk-mib", value)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--chunk-mib" in proc.stderr


# the service extra's modules (pyproject.toml's ``service`` list, by their import names)
SERVICE_EXTRA_MODULES = (*SERVICE_EXTRAS, "httptools", "uvloop", "llguidance")


def test_serve_http_without_the_service_extra_says_which_extra(tmp_path) -> None:
    """After the README's install (``.[text]``, no ``service``), ``serve --http`` says in one line
    which extra to install and exits 2: no traceback (it was ``ModuleNotFoundError: httpx``)."""
    env = without_modules(tmp_path / "site", SERVICE_EXTRA_MODULES, {**os.environ, "PYTHONPATH": str(REPO)})
    probe = subprocess.run([sys.executable, "-c", "import httpx"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert probe.returncode == 1 and "No module named 'httpx'" in probe.stderr  # the blocker holds
    done = subprocess.run([sys.executable, "-m", "tools.coli_kv", "serve", "--http", "0", "--root",
                           str(tmp_path / "root"), "--model", "tiny"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
    assert lines[0].startswith("coli-kv serve: error: --http needs the service extra")
    assert 'pip install -e ".[service]"' in lines[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "root").exists()  # nothing left behind
