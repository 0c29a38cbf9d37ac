"""bench.peer's multi-turn CPU key: each server's process tree's CPU seconds over the run (the
work, which a loaded machine's waits do not enter), ours / llama.cpp, and its row in the table."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from bench.peer import table as peer_table
from bench.peer_multiturn import aiperf_window, busy_window, multiturn_keys, sample_run, server_budget_s, tree_cpu_s

SPIN = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
        "print('spun', flush=True)\nsys.stdin.read()")  # 0.3 s of CPU, then it waits, alive


def test_a_process_tree_counts_its_children_cpu() -> None:
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "spun\n"
        alone = tree_cpu_s(child.pid)
        assert alone >= 0.25  # its own spin (the clock ticks round down by at most one)
        assert tree_cpu_s(os.getpid()) >= alone  # this process's tree holds the child's
    finally:
        child.communicate("")
    assert tree_cpu_s(child.pid) == 0.0  # gone: nothing to read


def test_cpu_ratio_where_both_sides_were_read_and_its_row() -> None:
    ours = {"tok_s": 3.0, "ttft_ms": 1.0, "itl_ms": 1.0, "server_cpu_s": 6.0}
    theirs = {"tok_s": 1.0, "ttft_ms": 4.0, "itl_ms": 2.0, "server_cpu_s": 8.0}
    keys = multiturn_keys(ours, theirs)
    assert keys["peer_multiturn_cpu_ratio"] == 0.75
    text = peer_table({"ours": {}, "llama_cpp": {}, **keys})
    assert "| ... the servers' CPU over the run (s) | 6.00 | 8.00 | 0.75 |" in text
    assert "peer_multiturn_cpu_ratio" not in multiturn_keys({**ours, "server_cpu_s": 0.0}, theirs)


def test_the_server_budget_for_the_goal() -> None:
    """Ours ran 4 s at 1,000 tok/s with the client spending 3.2 s (0.8 of a core); llama.cpp 500 tok/s: at
    3x its rate the same tokens take 8/3 s, of which 2 cores less the client's 0.8 leave 1.2 x 8/3 = 3.2 s."""
    ours = {"tok_s": 1000.0, "busy_s": 4.0, "client_cpu_s": 3.2}
    assert server_budget_s(ours, 500.0, 2) == pytest.approx(3.2)
    assert server_budget_s({**ours, "client_cpu_s": 9.0}, 500.0, 2) == 0.0  # a client busier than the cores
    keys = multiturn_keys({**ours, "ttft_ms": 1.0, "itl_ms": 1.0}, {"tok_s": 500.0, "ttft_ms": 1.0, "itl_ms": 1.0})
    assert keys["peer_multiturn_server_budget_s"] == pytest.approx(server_budget_s(ours, 500.0, os.cpu_count() or 1))
    assert "| ... the CPU our server could spend at 3x llama.cpp's tok/s (s) | 3.20 | | |" in peer_table(
        {"ours": {}, "llama_cpp": {}, **keys, "peer_multiturn_server_budget_s": 3.2})
    assert "peer_multiturn_server_budget_s" not in multiturn_keys({"tok_s": 1.0, "ttft_ms": 1.0, "itl_ms": 1.0},
                                                                    {"tok_s": 1.0, "ttft_ms": 1.0, "itl_ms": 1.0})


def test_the_busy_window_is_where_the_server_worked_and_the_clients_cpu_in_it() -> None:
    # (seconds, server CPU, client CPU): the client starts up alone, then both work, then it reports alone
    samples = [(0.0, 5.0, 0.0), (1.0, 5.0, 0.9), (2.0, 5.5, 1.4), (3.0, 6.2, 2.0), (4.0, 6.2, 2.6)]
    assert busy_window(samples) == {"busy_s": 2.0, "client_cpu_s": 1.1}  # from 1.0 (before it grew) to 3.0
    idle = [(0.0, 5.0, 0.0), (1.0, 5.0, 1.0)]  # a server that never worked (or none read): the whole run
    assert busy_window(idle) == {"busy_s": 1.0, "client_cpu_s": 1.0}


def test_a_sampled_run_reads_the_clients_cpu_and_its_status(tmp_path: Path) -> None:
    status, samples = sample_run([sys.executable, "-c", SPIN.replace("sys.stdin.read()", "sys.exit(3)")], None,
                                 tmp_path / "client.log", period=0.05)
    assert status == 3 and (tmp_path / "client.log").read_text() == "spun\n"
    assert samples[-1][2] >= 0.2 and all(server == 0.0 for _, server, _ in samples)  # no server: none read
    assert [t for t, _, _ in samples] == sorted(t for t, _, _ in samples)


def test_the_window_aiperf_timed_is_read_from_the_samples_between_its_times() -> None:
    # (seconds since the samples began, server CPU, client CPU); the samples began at epoch 1000.0
    samples = [(0.0, 5.0, 0.0), (1.0, 5.0, 0.9), (2.0, 5.5, 1.4), (3.0, 6.2, 2.0), (9.0, 9.0, 8.0)]
    start, end = datetime.fromtimestamp(1001.5), datetime.fromtimestamp(1002.5)  # local time, as aiperf writes
    export = {"start_time": start.isoformat(), "end_time": end.isoformat()}
    window = aiperf_window(samples, 1000.0, export)
    assert window is not None and window["busy_s"] == pytest.approx(1.0)
    assert window["client_cpu_s"] == pytest.approx(1.7 - 1.15)  # interpolated at 1.5 s and 2.5 s
    # the server's work after the last reply (9.0) stretches busy_window's window, not aiperf's
    assert busy_window(samples)["busy_s"] == 8.0
    assert aiperf_window(samples, 1000.0, {}) is None  # no times: busy_window is used instead
    late = {"start_time": start.isoformat(), "end_time": datetime.fromtimestamp(1010.0).isoformat()}
    assert aiperf_window(samples, 1000.0, late) is None  # past the last sample
