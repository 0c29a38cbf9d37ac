"""bench.dsa runs as a module at a small T and reports its keys."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_dsa_bench_runs_and_reports_its_keys() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.dsa", "--quick", "--json", "--length", "4096"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["T"] == 4096 and res["index_topk"] == 2048
    for key in ("dsa_speedup_T4096", "dsa_speedup_f32_T4096", "scoring_ms_T4096", "topk_ms_T4096",
                "attend_fp8_ms_T4096", "dense_fp8_ms_T4096", "sparse_fp8_ms_T4096"):
        assert res[key] > 0, key


def test_dsa_bench_refuses_a_context_not_longer_than_index_topk() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.dsa", "--length", "2048"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 2 and "index_topk" in out.stderr
