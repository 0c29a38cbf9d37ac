"""``coli-kv generate --root R --session ID``, ``ls``, ``rm``, ``fork`` (in-process and real processes)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kernels.model import load_model
from kernels.model.sampling import Sampler
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turn_loop import reference_turns
from tests.support.session_util import REPO
from tools.cmd_sessions import session_generate
from tools.coli_kv import main

PROMPT = [72, 101, 108, 108, 111, 33]


def _json(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def _ids(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def test_generate_creates_then_resumes(tmp_path, capsys) -> None:
    root = str(tmp_path)
    sampler = Sampler(0.8, 10, 1.0, 3)
    base = ["generate", "--root", root, "--session", "chat", "--json"]
    assert main(base + ["--model", "tiny", "--prompt-ids", _ids(PROMPT), "--max-new", "5", "--kv", "fp8",
                        "--temperature", "0.8", "--top-k", "10", "--seed", "3", "--commit-every", "2"]) == 0
    first = _json(capsys)
    assert first["created"] is True and len(first["tokens"]) == 5 and first["kv_dtype"] == "fp8"
    history = SessionStore(root).history("chat")
    second_prompt = history + [44, 32]
    # resume: no --model (the manifest knows it), no sampling flags (the session keeps its own)
    assert main(base + ["--prompt-ids", _ids(second_prompt), "--max-new", "4"]) == 0
    second = _json(capsys)
    assert second["created"] is False and second["reused_prefix"] == len(history) - 1
    assert second["resume"]["verified"] == "bit-identical"
    expected = reference_turns(load_model("tiny"), "fp8", [(PROMPT, 5), (second_prompt, 4)], sampler)
    assert [first["tokens"], second["tokens"]] == expected
    # continuing without prompt ids (the session layer's own entry point)
    ns = argparse.Namespace(root=root, session="chat", model=None, prompt_ids=None, max_new=3, kv=None,
                            backend="cpu", temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_at_eos=False,
                            json=True, commit_every=64)
    assert session_generate(ns) == 0
    third = _json(capsys)
    expected = reference_turns(load_model("tiny"), "fp8", [(PROMPT, 5), (second_prompt, 4), (None, 3)], sampler)
    assert third["tokens"] == expected[2]
    # the same model given again is accepted; a different model or kv dtype is refused in one line
    assert main(base + ["--model", "tiny", "--prompt-ids", _ids(PROMPT), "--max-new", "1"]) == 0
    capsys.readouterr()
    assert main(base + ["--kv", "f32", "--prompt-ids", "1", "--max-new", "1"]) != 0
    err = capsys.readouterr().err
    assert "fp8" in err and len(err.strip().splitlines()) == 1


def test_generate_errors_are_one_line(tmp_path, capsys) -> None:
    rc = main(["generate", "--root", str(tmp_path), "--session", "new", "--prompt-ids", "1,2"])
    err = capsys.readouterr().err
    assert rc != 0 and "--model" in err and "Traceback" not in err
    rc = main(["generate", "--root", str(tmp_path), "--session", "../evil", "--model", "tiny",
               "--prompt-ids", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and "invalid session id" in err
    assert not (tmp_path.parent / "evil").exists()


def test_ls_rm_fork(tmp_path, capsys) -> None:
    root = str(tmp_path)
    assert main(["generate", "--root", root, "--session", "a", "--model", "tiny", "--prompt-ids",
                 _ids(PROMPT), "--max-new", "6"]) == 0
    capsys.readouterr()
    assert main(["fork", "--root", root, "a", "b", "--at", "4", "--json"]) == 0
    assert _json(capsys)["tokens"] == 4
    assert main(["ls", "--root", root, "--json"]) == 0
    listing = _json(capsys)["sessions"]
    assert [s["id"] for s in listing] == ["a", "b"]
    for s in listing:
        assert {"id", "tokens", "kv_dtype", "kv_path", "bytes", "model"} <= set(s)
    assert listing[0]["tokens"] == len(PROMPT) + 5 and listing[0]["model"] == "tiny"
    assert main(["ls", "--root", root]) == 0
    table = capsys.readouterr().out
    assert "ID" in table and "a " in table
    assert main(["rm", "--root", root, "b", "--json"]) == 0
    assert _json(capsys) == {"removed": "b"}
    assert main(["rm", "--root", root, "b"]) != 0
    assert "no session" in capsys.readouterr().err
    assert main(["ls", "--root", str(tmp_path / "nothing")]) != 0


def test_real_processes(tmp_path) -> None:
    """Two separate `python -m tools generate` processes, then `ls`, as a user would run them."""
    root = str(tmp_path)

    def cli(*argv: str) -> dict:
        proc = subprocess.run([sys.executable, "-m", "tools", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = cli("generate", "--root", root, "--session", "p", "--model", "tiny", "--prompt-ids",
                _ids(PROMPT), "--max-new", "4", "--json")
    history = SessionStore(root).history("p")
    second = cli("generate", "--root", root, "--session", "p", "--prompt-ids", _ids(history + [10]),
                 "--max-new", "4", "--json")
    assert [first["tokens"], second["tokens"]] == reference_turns(
        load_model("tiny"), "fp8", [(PROMPT, 4), (history + [10], 4)], Sampler())
    listing = cli("ls", "--root", root, "--json")["sessions"]
    assert listing[0]["tokens"] == len(history) + 1 + 3


@pytest.mark.parametrize("argv", [["ls"], ["rm", "x"], ["fork", "a", "b"]])
def test_root_is_required(argv, capsys) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    capsys.readouterr()
