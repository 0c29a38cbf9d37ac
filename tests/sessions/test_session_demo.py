"""``coli-kv demo``: the README's main job (separate processes, token-exact verdict)."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.support.session_util import REPO
from tools import cmd_demo
from tools.coli_kv import main


def test_demo_runs_in_real_processes_and_is_token_exact(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tools", "demo", "--max-new", "10", "--root",
                           str(tmp_path), "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "token-exact: yes" in lines
    out = json.loads(lines[-1])
    assert out["token_exact"] is True and out["bytes_ratio_f32_over_fp8"] > 3
    for kv in ("fp8", "f32"):
        run = out["runs"][kv]
        assert run["token_exact"] and len(run["outputs"]) == 3 and all(len(o) == 10 for o in run["outputs"])
        assert len(run["resume_s"]) == 2  # turns 2 and 3 resumed in their own processes


def test_demo_says_no_and_fails_on_any_mismatch(tmp_path, capsys, monkeypatch) -> None:
    real = cmd_demo.reference_turns

    def off_by_one(*args, **kwargs):
        outs = real(*args, **kwargs)
        outs[-1][-1] = (outs[-1][-1] + 1) % 256
        return outs

    monkeypatch.setattr(cmd_demo, "reference_turns", off_by_one)
    assert main(["demo", "--max-new", "4", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "token-exact: no" in out and "token-exact: yes" not in out
