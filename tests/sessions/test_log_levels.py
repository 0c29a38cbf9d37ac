"""The log surface (sessionstore.log): levels from the environment, and structlog imported only by
an event that passes the level (each of our processes would pay 0.1-0.2 s to import it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROGRAM = """
import sys
from sessionstore.log import get_logger
log = get_logger("probe")
log.debug("probe.debug", n=1)
log.info("probe.info", n=2)
print("after info:", "structlog" in sys.modules, flush=True)
log.warning("probe.warning", n=3)
log.error("probe.error", n=4)
print("after error:", "structlog" in sys.modules, flush=True)
"""


def _run(**env: str) -> tuple[list[str], list[str]]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COLI_LOG")}
    done = subprocess.run([sys.executable, "-c", PROGRAM], cwd=REPO, capture_output=True, text=True, check=True,
                          env={**clean, "PYTHONPATH": str(REPO), **env}, timeout=60)
    return done.stdout.splitlines(), done.stderr.splitlines()


def test_by_default_warnings_print_and_structlog_waits_for_the_first() -> None:
    out, err = _run()
    assert out == ["after info: False", "after error: True"]
    events = [line.split("] ", 1)[1].split()[0] for line in err]  # "<time> [<level>] <event> <key>=<value> ..."
    assert events == ["probe.warning", "probe.error"], err
    assert "n=3" in err[0] and "component=probe" in err[0]


def test_json_shows_info_and_off_shows_nothing() -> None:
    out, err = _run(COLI_LOG="json")
    assert out == ["after info: True", "after error: True"]
    events = [json.loads(line) for line in err]
    assert [(e["event"], e["level"], e["n"], e["component"]) for e in events] == [
        ("probe.info", "info", 2, "probe"), ("probe.warning", "warning", 3, "probe"),
        ("probe.error", "error", 4, "probe")]
    out, err = _run(COLI_LOG="off")
    assert (out, err) == (["after info: False", "after error: False"], [])
    out, err = _run(COLI_LOG="json", COLI_LOG_LEVEL="error")
    assert [json.loads(line)["event"] for line in err] == ["probe.error"]
