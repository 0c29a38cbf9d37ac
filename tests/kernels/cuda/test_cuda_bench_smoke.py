"""bench.cuda_paths runs end to end: on the CPU emulator at tiny shapes (every timed call of the GPU
run, against its baseline), and without a device it says so and exits 0."""
from __future__ import annotations

import json

import pytest

from bench import cuda_paths
from kernels.cuda.device import cuda_status
from kernels.cuda.emulator import compiler


@pytest.mark.skipif(compiler() is None, reason="the CUDA emulator needs a C++ compiler (g++)")
def test_emulated_run_reports_every_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert cuda_paths.main(["--emulate", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["emulated"] is True
    assert out["int4_over_fp8_ratio_T64"] > 0 and out["polar4_over_fp8_ratio_T64"] > 0
    for kind in ("f32", "fp8", "int4", "polar4"):
        for n_q in (1, 2):
            assert out[f"sparse_over_dense_ratio_{kind}_S{n_q}"] > 0
            assert out[f"sparse_ms_{kind}_S{n_q}"] > 0


@pytest.mark.skipif(cuda_status()[0], reason="a device is present: the real run is bench/gpu_check.sh's")
def test_without_a_device_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert cuda_paths.main(["--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "cuda_skipped" in out
