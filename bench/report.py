"""What the benches print at their end: with ``--json``, one JSON object as the last line (what
tests/bench and BENCHMARKS.md read); a bench without a table of its own prints its figures one a line."""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

JSON_HELP = "print one JSON object as the last line"


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """The benches' ``--json`` flag."""
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def json_line(result: Mapping[str, Any], as_json: bool, *, sort_keys: bool = False) -> int:
    """Print ``result`` as one JSON line when ``as_json``; 0, the bench's exit status."""
    if as_json:
        print(json.dumps(result, sort_keys=sort_keys))
    return 0


def figures(result: Mapping[str, Any], as_json: bool, *, width: int | None = None) -> int:
    """``result`` as one JSON line (``as_json``), else a figure a line: its key padded to ``width``
    and its value (``width`` None: ``key: value``); 0, the bench's exit status."""
    if as_json:
        return json_line(result, True)
    for key, value in result.items():
        print(f"{key}: {value}" if width is None else f"{key:{width}s} {value}")
    return 0


__all__ = ["JSON_HELP", "add_json_flag", "figures", "json_line"]
