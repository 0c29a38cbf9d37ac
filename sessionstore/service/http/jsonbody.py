"""The one reader of JSON request bodies: every malformed body is a 400, never a 500.

Checked with named limits: nesting deeper than ``MAX_JSON_DEPTH`` (counted over the raw bytes
before the parser recurses), integers longer than ``MAX_INT_DIGITS`` digits (Python would spend
time converting them, or refuse past 4300 digits), ``NaN`` / ``Infinity`` and numbers past the
float range (not numbers a field can take), bytes that are not UTF-8; after parsing, a string or
key holding a lone surrogate (a ``\\ud800`` escape without its pair: not text, and no encoder
takes it) is refused naming its field. The body's size is bounded before it reaches here
(``ServiceLimits.max_body_bytes``).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from sessionstore.service.errors import ApiError

MAX_JSON_DEPTH = 64  # arrays and objects inside each other
MAX_INT_DIGITS = 40  # digits of one integer (a u64 seed has 20)

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")
# Cheap proofs over the raw bytes that the per-value checks have nothing to find, so a big body (a
# 32k-id prompt) skips them: with no run of more than MAX_INT_DIGITS digits anywhere (every digit
# read as 0, then one substring search), no integer can be that long (json.loads then needs no
# per-integer callback); with no ``\ud800``-``\udfff`` escape anywhere, no string can hold a
# surrogate (UTF-8 cannot encode one: ``decode`` refuses it), so the walk over every value is
# skipped. A match (even inside a string) takes the full checks.
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"0" * 9)
_LONG_DIGITS = b"0" * (MAX_INT_DIGITS + 1)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_STEP = np.zeros(256, dtype=np.int8)  # [256] i8: a byte's change of the nesting depth
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def _invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_json")


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (brackets inside strings not counted)."""
    steps = _STEP[np.frombuffer(_STRING.sub(b"", raw), dtype=np.uint8)]  # [n] i8: +1 opens, -1 closes
    return int(max(np.cumsum(steps, dtype=np.int64).max(initial=0), 0))


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _invalid(f"an integer of {len(digits.lstrip('-'))} digits exceeds the limit of {MAX_INT_DIGITS}")
    return int(digits)


def _constant(name: str) -> Any:
    raise _invalid(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _invalid(f"the number {text[:40]} is out of range")
    return value


def lone_surrogate_at(obj: Any, path: str = "") -> str | None:
    """The field path of the first string or key in ``obj`` holding a lone surrogate, or None."""
    if isinstance(obj, str):
        return path if _SURROGATE.search(obj) else None
    if isinstance(obj, dict):
        for key, value in obj.items():
            inner = f"{path}.{key}" if path else str(key)
            if _SURROGATE.search(key):
                return path or "(a key)"
            found = lone_surrogate_at(value, inner)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            found = lone_surrogate_at(value, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def read_json_body(raw: bytes) -> Any:
    """``raw`` (UTF-8 JSON) parsed under this module's limits; a refusal is a 400 ``invalid_json``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(f"the request body is not UTF-8 (byte {exc.start})") from None
    openers = raw.count(b"[") + raw.count(b"{")  # fewer than the limit cannot nest past it: no scan
    depth = json_depth(raw) if openers > MAX_JSON_DEPTH else 0
    if depth > MAX_JSON_DEPTH:
        raise _invalid(f"the request body nests {depth} deep, past the limit of {MAX_JSON_DEPTH}")
    parse_int = _int if _LONG_DIGITS in raw.translate(_DIGITS_AS_ZERO) else None  # None: all are short
    try:
        obj = json.loads(text, parse_int=parse_int, parse_float=_float, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise _invalid(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # a depth the scan missed: still the client's malformed body
        raise _invalid("the request body nests too deep") from None
    where = lone_surrogate_at(obj) if _SURROGATE_ESCAPE.search(raw) else None
    if where is not None:
        raise _invalid(f"{where}: a string holds a lone surrogate (an unpaired \\ud800-\\udfff escape): not text",
                       param=where or None)
    return obj


__all__ = ["MAX_INT_DIGITS", "MAX_JSON_DEPTH", "json_depth", "lone_surrogate_at", "read_json_body"]
