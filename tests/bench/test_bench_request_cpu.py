"""bench.request_cpu's parts that need no server: the CPU clock it reads and its refusal of a
baseline that is no tree (the measurement itself starts real servers: a bench, not a test)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench.request_cpu import cpu_seconds, main


def test_cpu_seconds_reads_this_process_and_only_grows() -> None:
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # burn a little CPU (the clock ticks in 1/CLK_TCK steps)
        pass
    assert 0 <= before <= cpu_seconds(os.getpid())


def test_a_baseline_that_is_no_tree_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--baseline", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no sessionstore tree" in err[0]
