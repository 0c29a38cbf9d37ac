"""``coli-kv demo``: the README's main job (separate processes, token-exact verdict).

The text demo runs on a model with a tokenizer and chat template (the shipped glm-mini by default;
here also a test-built one), the id demo on the random tiny model."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.session_util import REPO
from tools import cmd_demo
from tools.coli_kv import main


def _demo(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tools", "demo", *args, "--json"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "token-exact: yes" in lines
    return json.loads(lines[-1])


def test_id_demo_runs_in_real_processes_and_is_token_exact(tmp_path) -> None:
    out = _demo(["--model", "tiny", "--turns", "3", "--max-new", "10", "--root", str(tmp_path)])
    assert out["token_exact"] is True and out["bytes_ratio"]["f32/fp8"] > 3
    for kv in ("fp8", "f32"):
        run = out["runs"][kv]
        assert run["token_exact"] and len(run["outputs"]) == 3 and all(len(o) == 10 for o in run["outputs"])


def test_text_demo_chats_in_real_processes_and_is_token_exact(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers", reason="the text extra (tokenizers) builds the test tokenizer")
    from tests.kernels.model.text.textkit import write_text_model

    model = write_text_model(tmp_path / "model", "glm")
    out = _demo(["--model", str(model), "--turns", "4", "--max-new", "8", "--root", str(tmp_path / "root")])
    for kv in ("fp8", "int4"):
        run = out["runs"][kv]
        assert run["token_exact"] and len(run["outputs"]) == 4 and len(run["texts"]) == 4
        assert all(1 <= len(o) <= 8 for o in run["outputs"])
    assert out["bytes_ratio"]["int4/fp8"] < 1  # the 4-bit tier is smaller on disk


def test_demo_says_no_and_fails_on_any_mismatch(tmp_path, capsys, monkeypatch) -> None:
    real = cmd_demo.reference_turns

    def off_by_one(*args, **kwargs):
        outs = real(*args, **kwargs)
        outs[-1][-1] = (outs[-1][-1] + 1) % 256
        return outs

    monkeypatch.setattr(cmd_demo, "reference_turns", off_by_one)
    assert main(["demo", "--model", "tiny", "--turns", "2", "--max-new", "4", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "token-exact: no" in out and "token-exact: yes" not in out


def test_the_default_demo_chats_with_the_shipped_model(tmp_path: Path) -> None:
    """README's main job as a new user runs it: `coli-kv demo` on glm-mini, readable text, exact."""
    pytest.importorskip("tokenizers", reason="the text extra (tokenizers) reads glm-mini's tokenizer")
    out = _demo(["--max-new", "12", "--root", str(tmp_path)])
    assert out["model"] == "glm-mini"
    for kv in ("fp8", "int4"):
        run = out["runs"][kv]
        assert run["token_exact"] and len(run["texts"]) == cmd_demo.DEFAULT_TURNS
        words = " ".join(run["texts"]).split()
        assert sum(w.strip(".,;:*()'`").isalpha() for w in words) >= len(words) // 2  # mostly words


@pytest.mark.parametrize("turns", ["1", str(len(cmd_demo.USER_TURNS) + 1)])
def test_a_turn_count_out_of_range_is_one_error_line(turns: str, tmp_path: Path, capsys) -> None:
    assert main(["demo", "--model", "tiny", "--turns", turns, "--root", str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--turns" in err[0] and "Traceback" not in err[0]
