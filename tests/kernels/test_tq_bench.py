"""bench.tq runs end to end as a module (tiny sizes) and reports its keys with sane values."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_tq_bench_runs_and_reports_its_keys() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.tq", "--quick", "--json", "--length", "300", "--rows", "64"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("int4", "polar4"):
        assert res[f"cpu_{name}_over_f32_ratio_T300"] > 0
        assert res[f"cpu_{name}_vs_decoded_rel_err"] < 2e-5
    for name in ("int4", "polar2", "polar3", "polar4", "polar5", "polar6"):
        assert res[f"{name}_encode_melem_s"] > 0 and res[f"{name}_decode_melem_s"] > 0
        assert 0 < res[f"{name}_rel_err_n512"] < 0.65
    assert res["bytes_per_token_v3_int4"] == 23_092 and res["bytes_per_token_v2_fp8"] == 45_556
    assert res["bytes_per_token_v1_f32"] == 179_716 and res["bytes_per_token_v3_polar4"] == 20_284
