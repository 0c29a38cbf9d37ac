"""Checks of decoded JSON fields, shared by the manifest and its commit state page (FORMAT.md 5.3).

Every check raises :class:`FormatError` (or :class:`LimitError`) naming the file (``where``) and
the field; a ``bool`` is never taken for an ``int``.
"""
from __future__ import annotations

import math
from typing import Any

from kernels.errors import FormatError, LimitError

MAX_PENDING = 256  # a durable stream's tail (FORMAT.md 5.5): the tokens after the last kv commit;
# the commit state page's payload holds this many ids of any vocab with a digest (tests assert it)


def need(obj: dict, key: str, kind: type | tuple, where: str) -> Any:
    """``obj[key]``, which must be present and of type ``kind``."""
    if key not in obj:
        raise FormatError(f"{where}: field {key!r} is missing")
    value = obj[key]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise FormatError(f"{where}: field {key!r} has type {type(value).__name__}")
    return value


def need_int(obj: dict, key: str, where: str, lo: int = 0, hi: int = (1 << 31) - 1) -> int:
    """``obj[key]``, an int in ``[lo, hi]``."""
    value = need(obj, key, int, where)
    if not lo <= value <= hi:
        raise FormatError(f"{where}: field {key!r} = {value} outside [{lo}, {hi}]")
    return value


def need_float(obj: dict, key: str, where: str) -> float:
    """``obj[key]``, a finite number."""
    value = float(need(obj, key, (int, float), where))
    if not math.isfinite(value):
        raise FormatError(f"{where}: field {key!r} is not finite")
    return value


def pending_from_json(data: dict, vocab: int, where: str) -> list[int]:
    """The validated ``pending`` field (0..MAX_PENDING token ids in [0, vocab))."""
    pending = need(data, "pending", list, where)
    if len(pending) > MAX_PENDING:
        raise LimitError(f"{where}: {len(pending)} pending tokens exceed the limit {MAX_PENDING}")
    for t in pending:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < max(vocab, 1):
            raise FormatError(f"{where}: pending token {t!r} outside the vocab")
    return list(pending)


__all__ = ["MAX_PENDING", "need", "need_int", "need_float", "pending_from_json"]
