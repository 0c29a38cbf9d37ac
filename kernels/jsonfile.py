"""The one bounded JSON read: a small JSON file (a model's ``config.json``, a weights index, ...)
read without ever holding more than its limit in memory.

Kernels holds it (it imports nothing of ours but the errors) so the decoder's loaders and the
session store read JSON files the same way.
"""
from __future__ import annotations

import json
import os
from typing import Any

from kernels.errors import FormatError, LimitError

__all__ = ["parse_json_bytes", "read_json_bounded"]


def parse_json_bytes(raw: bytes, where: str, what: str = "") -> Any:
    """``raw`` (UTF-8 JSON) parsed; FormatError ``<where>: [<what> ]not valid JSON (...)`` if not."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        label = f"{what} is " if what else ""
        raise FormatError(f"{where}: {label}not valid JSON ({exc})") from None


def read_json_bounded(path: str | os.PathLike[str], limit: int, what: str = "") -> Any:
    """Parse the JSON file ``path``, refusing one larger than ``limit`` bytes (LimitError) after
    reading at most ``limit + 1`` bytes. Not valid UTF-8 JSON raises FormatError. ``what`` names
    the file in both messages (``<path>: <what> larger than ...``); a missing file raises the
    plain FileNotFoundError, for the caller to say what was missing."""
    with open(path, "rb") as fh:
        raw = fh.read(limit + 1)
    if len(raw) > limit:
        label = f"{what} " if what else ""
        raise LimitError(f"{os.fspath(path)}: {label}larger than {limit} bytes")
    return parse_json_bytes(raw, os.fspath(path), what)
