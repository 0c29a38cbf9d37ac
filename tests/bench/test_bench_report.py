"""bench.report: the benches' last JSON line and their figure-a-line table, as each bench printed them
before they shared it (step_rows: ``f"{key:24s} {value}"``; request_cpu: ``f"{key}: {value}"``)."""
from __future__ import annotations

import argparse
import json

import pytest

from bench.report import JSON_HELP, add_json_flag, figures, json_line

RESULT = {"step_rows1_us": 12.5, "ratio": 0.91, "reps": [1, 2]}


def test_json_is_one_object_on_the_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    print("a table first")
    assert json_line({"b": 1, "a": 2}, True, sort_keys=True) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == '{"a": 2, "b": 1}' and json.loads(last) == {"a": 2, "b": 1}
    assert json_line(RESULT, False) == 0 and capsys.readouterr().out == ""  # without --json: nothing


def test_figures_print_a_padded_table_or_the_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert figures(RESULT, False, width=24) == 0
    assert capsys.readouterr().out == "".join(f"{k:24s} {v}\n" for k, v in RESULT.items())
    figures(RESULT, False)
    assert capsys.readouterr().out == "step_rows1_us: 12.5\nratio: 0.91\nreps: [1, 2]\n"
    figures(RESULT, True, width=24)
    assert json.loads(capsys.readouterr().out) == RESULT


def test_the_json_flag() -> None:
    parser = argparse.ArgumentParser()
    add_json_flag(parser)
    assert parser.parse_args(["--json"]).json and not parser.parse_args([]).json
    assert JSON_HELP in parser.format_help()
