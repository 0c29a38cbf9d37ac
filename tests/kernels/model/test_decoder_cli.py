"""``coli-kv generate`` without sessions: in-process through the dispatcher, and one real subprocess."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kernels.model import Sampler, generate, load_model
from tools.coli_kv import main

REPO = Path(__file__).resolve().parents[3]


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_last_line_has_exactly_n_tokens(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, "--model", "tiny", "--prompt-ids", "72,101,108,108,111", "--max-new", "9", "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    doc = json.loads(lines[-1])
    model = load_model("tiny")
    expect = generate(model, model.new_cache("f32"), [72, 101, 108, 108, 111], 9).tokens
    assert doc["tokens"] == expect and doc["kv"] == "f32" and doc["prompt_tokens"] == 5
    assert lines[0] == " ".join(map(str, expect))


def test_sampling_flags_and_fp8(capsys: pytest.CaptureFixture) -> None:
    argv = ("--model", "tiny", "--prompt-ids", "1, 2,3", "--max-new", "12", "--kv", "fp8", "--temperature", "0.8",
            "--top-k", "30", "--top-p", "0.9", "--seed", "77", "--json")
    code, out, _ = run(capsys, *argv)
    again = run(capsys, *argv)[1]
    tokens = json.loads(out.strip().splitlines()[-1])["tokens"]
    assert code == 0 and json.loads(again.strip().splitlines()[-1])["tokens"] == tokens
    model = load_model("tiny")
    sampler = Sampler(temperature=0.8, top_k=30, top_p=0.9, seed=77)
    assert tokens == generate(model, model.new_cache("fp8"), [1, 2, 3], 12, sampler).tokens


def test_stop_at_eos_flag_accepted(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run(capsys, "--model", "tiny", "--prompt-ids", "5", "--max-new", "4", "--stop-at-eos", "--json")
    doc = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and 1 <= len(doc["tokens"]) <= 4 and doc["stopped_at_eos"] == (doc["tokens"][-1] == 257)


@pytest.mark.parametrize(
    "argv, text",
    [
        (("--model", "tiny", "--prompt-ids", "1,x"), "'x' is not an integer"),
        (("--model", "tiny", "--prompt-ids", "1,,2"), "comma-separated integers"),
        (("--model", "tiny", "--prompt-ids", ""), "comma-separated integers"),
        (("--model", "tiny", "--prompt-ids", "1,260"), "token id 260 at index 1 is outside the vocabulary"),
        (("--model", "tiny", "--prompt-ids", "-3"), "token id -3"),
        (("--model", "tiny"), "--prompt-ids, --prompt or --messages is required"),
        (("--prompt-ids", "1"), "--model is required"),
        (("--model", "/nonexistent/model", "--prompt-ids", "1"), "not a model directory"),
        (("--model", "tiny", "--prompt-ids", "1", "--top-p", "2"), "top_p"),
        (("--model", "tiny", "--prompt-ids", "1", "--max-new", "-2"), "max_new"),
    ],
)
def test_bad_input_is_one_error_line(capsys: pytest.CaptureFixture, argv: tuple, text: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and text in err and err.startswith("coli-kv generate: error:")


def test_bad_model_directory_is_one_error_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, _, err = run(capsys, "--model", str(tmp_path), "--prompt-ids", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "'llama' is not supported" in err


def test_cuda_backend_runs_or_says_why(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, "--model", "tiny", "--prompt-ids", "1,2", "--max-new", "3", "--backend", "cuda")
    if code == 0:  # a machine with a usable device
        assert len(out.split()) == 3
    else:
        assert len(err.strip().splitlines()) == 1 and "cuda" in err.lower()


def test_session_options_delegate(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    fake = types.ModuleType("tools.cmd_sessions")
    fake.register = lambda subparsers: None
    fake.session_generate = lambda args: seen.append(args) or 0
    monkeypatch.setitem(sys.modules, "tools.cmd_sessions", fake)
    code, _, _ = run(capsys, "--root", "/tmp/r", "--session", "s1", "--commit-every", "8", "--prompt-ids", "1")
    assert code == 0 and len(seen) == 1
    args = seen[0]
    assert (args.root, args.session, args.commit_every, args.model, args.temperature) == ("/tmp/r", "s1", 8, None, None)
    run(capsys, "--session", "s2")  # --model and --prompt-ids are optional for sessions
    assert seen[1].session == "s2" and seen[1].prompt_ids is None and seen[1].commit_every == 64


def test_real_subprocess() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools", "generate", "--model", "tiny", "--prompt-ids", "104,105", "--max-new", "5",
         "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={"COLI_LOG": "off", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    model = load_model("tiny")
    assert doc["tokens"] == generate(model, model.new_cache("f32"), [104, 105], 5).tokens
    bad = subprocess.run([sys.executable, "-m", "tools", "generate", "--model", "tiny", "--prompt-ids", "abc"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
