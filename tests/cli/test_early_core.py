"""``coli-kv serve --http`` starts the engine core's process before it imports anything of ours
(tools/early_core.py), so the two processes import side by side; a process nobody takes exits."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sessionstore.service.http import core_client
from sessionstore.service.wire import CoreConfig
from tools import early_core
from tools.coli_kv import main


def test_the_early_core_runs_the_servers_core_module() -> None:
    assert early_core.CORE_MODULE == core_client.CORE_MODULE


@pytest.mark.parametrize(("argv", "wanted"), [
    (["serve", "--http", "127.0.0.1:0", "--root", "r"], True),
    (["serve", "--root", "r", "--http=0"], True),
    (["serve", "--root", "r", "--inbox", "i"], False),
    (["generate", "--http"], False),
    ([], False),
])
def test_only_an_http_serve_starts_it(argv: list[str], wanted: bool) -> None:
    assert early_core.wants_core(argv) is wanted


def test_a_refused_serve_ends_the_core_it_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    taken: list[subprocess.Popen[bytes] | None] = []
    take = early_core.take
    monkeypatch.setattr(early_core, "take", lambda: taken.append(take()) or taken[-1])
    assert main(["serve", "--http", "127.0.0.1:0", "--root", str(tmp_path / "root")]) == 2  # no --model
    assert "--model" in capsys.readouterr().err
    started = [p for p in taken if p is not None]
    assert len(started) == 1 and started[0].returncode == 0  # started, then given no configuration: exit 0
    assert early_core.take() is None


def test_a_started_core_is_used_and_a_swapped_module_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's CoreProcess takes the started process when it runs CORE_MODULE; a test launcher
    that swapped the module gets a process of its module, and the started one is ended."""
    config = CoreConfig(root="/nonexistent", model="tiny", kv_dtype="fp8", limits={}, commit_every=None,
                        durable_stream=False, max_kv_bytes=None, remote=None, host_id=None, lease_ttl=None,
                        advertise_url=None, max_disk_bytes=None, ship_every_commit=False, sweep_interval=1.0,
                        requests="", events="", parent_pid=0)
    started = subprocess.Popen([sys.executable, "-m", core_client.CORE_MODULE], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)
    core = core_client.CoreProcess(config, started)
    assert core.proc is started
    assert started.wait(timeout=60) == 0  # parent_pid 0 is not its parent: it exits at once
    other = subprocess.Popen([sys.executable, "-m", core_client.CORE_MODULE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    monkeypatch.setattr(core_client, "CORE_MODULE", "tests.support.no_such_core")
    core = core_client.CoreProcess(config, other)
    assert core.proc is not other and other.returncode == 0
    assert core.proc.wait(timeout=60) != 0  # the swapped module's process (here: no such module)
