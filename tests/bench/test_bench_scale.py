"""``python -m bench.scale`` runs end to end as a module (tiny sizes) and prints its keys."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_scale_bench_restore_key_runs_and_reports() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.scale", "--quick", "--reps", "1", "--json",
                          "--only", "restore_offloaded_over_raw_read"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["restore_offloaded_over_raw_read"] > 0
    assert res["restore_bundle_bytes"] > 0 and res["restore_kv_bytes"] > 0
    assert "restore_offloaded_over_raw_read" in res["goals"]


@pytest.mark.timeout(600)
def test_scale_bench_server_keys_run_and_report() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.scale", "--quick", "--reps", "1", "--json",
                          "--only", "server_scale"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ready_s_100k_over_100"] > 0 and res["first_request_100k_over_100"] > 0
    assert res["list_page_ms_100k"] > 0 and res["server_sizes"] == [100, 2000]
    assert {"ready_s_100k_over_100", "first_request_100k_over_100"} <= set(res["goals"])


@pytest.mark.timeout(300)
def test_scale_bench_shipping_keys_run_and_report() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.scale", "--quick", "--reps", "1", "--json",
                          "--only", "shipping"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert 1.0 <= res["turn_ship_bytes_over_turn_records"] <= 1.5  # the turn's records, not the session
    assert res["turn_ship_baseline_bundle_over_turn_records"] > 1.5
    assert res["takeover_s"] >= res["takeover_lease_ttl_s"] and res["takeover_fetch_s"] > 0
    assert res["goals"]["turn_ship_bytes_over_turn_records"]["met"]
    assert 1.0 <= res["cut_shipped_bytes_ratio"] <= 1.5  # a cut ships its new records too, not the session
    assert res["cut_baseline_bundle_over_turn_records"] > 1.5


@pytest.mark.timeout(600)
def test_fleet_stores_bench_reports_moto_and_seaweedfs_in_one_run() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.fleet_stores", "--quick", "--reps", "1", "--json"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for store in ("moto", "seaweedfs"):
        r = res[store]
        assert 1.0 <= r["turn_ship_bytes_over_turn_records"] <= 1.5 and 1.0 <= r["cut_shipped_bytes_ratio"] <= 1.5
        assert r["takeover_s"] >= r["takeover_lease_ttl_s"] and r["restore_offloaded_over_raw_read"] > 0
        assert r["lease_acquire_ms"] > 0 and r["lease_samples"] > 0
    assert set(res["seaweedfs_over_moto"]) >= {"takeover_s", "lease_acquire_ms", "restore_offloaded_s"}
