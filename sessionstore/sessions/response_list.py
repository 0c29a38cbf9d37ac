"""A session's stored responses (``responses.json``, optional, FORMAT.md 5.11): the Responses API's
records (FORMAT.md 7.3) whose checkpoints this session holds, kept in the session's directory so
that a bundle (and so the fleet) carries them with the session. Each item is one record's JSON
object; the service parses them (:mod:`sessionstore.service.wire.response_records`), this module only
keeps the list: a JSON array of objects, at most :data:`MAX_RESPONSES_BYTES`, replaced whole and
durably."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kernels.errors import FormatError
from kernels.jsonfile import read_json_bounded
from sessionstore.kvfile import atomic_replace, readable_temp, unlink_durably

RESPONSES_NAME = "responses.json"
MAX_RESPONSES_BYTES = 32 << 20


def read_response_list(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The session directory's stored responses (empty when it has none); a file that is not a
    JSON array of objects is a FormatError naming it."""
    path = Path(directory) / RESPONSES_NAME
    try:
        items = read_json_bounded(path, MAX_RESPONSES_BYTES, "responses")
    except FileNotFoundError:
        return []
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise FormatError(f"{path}: expected a JSON array of response objects")
    return items


def write_response_list(directory: str | os.PathLike[str], items: list[dict[str, Any]]) -> None:
    """Replace the list whole and durably (temp, fsync, rename, fsync directory); none: removed."""
    path = Path(directory) / RESPONSES_NAME
    if not items:
        unlink_durably(path)
        return
    data = json.dumps(items, separators=(",", ":")).encode()
    if len(data) > MAX_RESPONSES_BYTES:
        raise FormatError(f"the session's stored responses are larger than {MAX_RESPONSES_BYTES} bytes")
    atomic_replace(path, data, make_temp=readable_temp(".responses-"), durable=True)


def response_list_bytes(directory: str | os.PathLike[str]) -> bytes | None:
    """The file's bytes as stored (checked to be a list of objects), or None when there is none."""
    path = Path(directory) / RESPONSES_NAME
    if not path.exists():
        return None
    read_response_list(directory)
    return path.read_bytes()


__all__ = ["MAX_RESPONSES_BYTES", "RESPONSES_NAME", "read_response_list", "response_list_bytes",
           "write_response_list"]
