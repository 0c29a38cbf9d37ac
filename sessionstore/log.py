"""structlog set-up: key=value lines on stderr by default, JSON lines with ``COLI_LOG=json``.

Without ``COLI_LOG`` only warnings and errors are printed (command output stays clean);
``COLI_LOG=text`` or ``COLI_LOG=json`` shows every state-change event (level ``info``);
``COLI_LOG=off`` silences everything; ``COLI_LOG_LEVEL`` overrides the level.

structlog is imported only when an event passes the level: importing it costs 0.1-0.2 s (it loads
its console renderer's helpers, rich and asyncio among them), paid by every process of ours (each
server is two, each command line one) though most never print a line. An event below the level
returns at an integer comparison, as structlog's own filtering logger would.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

_threshold: int | None = None  # the lowest level printed (None: not read yet); above CRITICAL: off
_structlog: Any = None  # the module once configured


def _level_from_env() -> int:
    mode = os.environ.get("COLI_LOG", "").lower()
    if mode == "off":
        return logging.CRITICAL + 1  # nothing passes, not even critical
    default_level = "info" if mode in ("text", "json") else "warning"
    level_name = os.environ.get("COLI_LOG_LEVEL", default_level).upper()
    level = getattr(logging, level_name, logging.INFO)
    return level if isinstance(level, int) else logging.INFO


def _threshold_now() -> int:
    global _threshold
    if _threshold is None:
        _threshold = _level_from_env()
    return _threshold


def _configured_structlog() -> Any:
    """structlog, imported and configured from the environment on first use."""
    global _structlog
    if _structlog is None:
        import structlog

        renderer: Any = (
            structlog.processors.JSONRenderer()
            if os.environ.get("COLI_LOG", "").lower() == "json"
            else structlog.dev.ConsoleRenderer(colors=False)
        )
        structlog.configure(
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                renderer,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(_threshold_now()),
            logger_factory=_stderr_logger,
            cache_logger_on_first_use=False,
        )
        _structlog = structlog
    return _structlog


def _stderr_logger(*_args: Any) -> Any:  # a structlog.PrintLogger
    # resolved per use, so a replaced sys.stderr (pytest's capture, a daemon's redirect) is honoured
    return _configured_structlog().PrintLogger(file=sys.stderr)


class Logger:
    """A component's logger (``component=name`` on every event): an event below the level costs a
    comparison; one at or above it goes to structlog, imported then."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def _emit(self, level: int, method: str, event: str, fields: dict[str, Any]) -> None:
        if level < _threshold_now():
            return
        getattr(_configured_structlog().get_logger(component=self.name), method)(event, **fields)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, "debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, "info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, "warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, "error", event, fields)

    def critical(self, event: str, **fields: Any) -> None:
        self._emit(logging.CRITICAL, "critical", event, fields)


def get_logger(name: str) -> Logger:
    """A logger bound to ``component=name``; follows :func:`reconfigure`."""
    return Logger(name)


def reconfigure() -> None:
    """Re-read ``COLI_LOG`` (tests and the CLI call this after changing the environment)."""
    global _threshold, _structlog
    _threshold = _level_from_env()
    if _structlog is not None:
        _structlog = None  # configured again, at the new level, by the next event that passes it
