"""``coli-kv fleet-demo`` end to end, as a user runs it: SeaweedFS, two hosts and Debian's nginx
started, a conversation served by both hosts in turn around a SIGKILL, token-exact, exit 0; and
nothing it started is left running or on disk.

Needs ``nginx`` (``.ci/run`` installs Debian's); ``COLI_NO_NGINX=1`` skips this file on purpose."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(os.environ.get("COLI_NO_NGINX") == "1", reason="COLI_NO_NGINX=1: skipped on purpose")]


def test_fleet_demo_survives_a_sigkilled_host_token_exact_and_cleans_up() -> None:
    env = {**os.environ, "COLI_LOG": "off", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tools", "fleet-demo", "--model", "tiny", "--max-new", "8",
                           "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["exact"] is True
    killed, other = report["killed"], report["took_over"]
    assert {killed, other} == {"a", "b"}
    assert report["hosts"] == [killed, killed, other, other]  # both hosts served it, in turn
    lines = proc.stderr.strip().splitlines()
    assert any(f"SIGKILL host {killed}" in line for line in lines)
    assert "token-exact: yes" in proc.stderr and lines[-1].startswith("stopped SeaweedFS, both hosts and nginx")
    for pid in report["pids"]:  # SeaweedFS, nginx and both hosts: stopped (a pid in use is another process now)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        assert report["tmp"] not in cmdline, cmdline  # each of them named its folder under the demo's tmp
    assert not Path(report["tmp"]).exists()
