"""The session and migration benchmarks run end to end as modules (``python -m bench.<name>`` from the
repository root, tiny sizes) and print their keys."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_bench(name: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", f"bench.{name}", "--json", *args],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_session_bench_runs_and_reports_its_keys(tmp_path):
    res = run_bench("session", "--quick", "--tokens", "300", "--dir", str(tmp_path))
    for key in ("resume_ratio", "resume_cold_ratio", "suspend_ratio", "resume_vs_recompute", "suspend_staged_ratio",
                "digest_in_decode_s", "suspend_floor_ratio"):
        assert res[key] > 0, key
    assert res["verify_result"] == "bit-identical"


@pytest.mark.timeout(300)
def test_migrate_bench_runs_and_reports_its_keys(tmp_path):
    res = run_bench("migrate", "--quick", "--tokens", "300", "--reps", "1", "--dir", str(tmp_path))
    for key in ("migrate_ratio", "zstd_ratio", "two_cps_ratio", "migrate_vs_durable_copies"):
        assert res[key] > 0, key


@pytest.mark.timeout(300)
def test_step_rows_bench_runs_and_reports_its_keys():
    res = run_bench("step_rows", "--reps", "1")
    for key in ("step_rows1_us", "step_rows16_us", "step_rows16_ref_us", "step_rows16_ref_ratio",
                "detok_us_per_token"):
        assert res[key] > 0, key
