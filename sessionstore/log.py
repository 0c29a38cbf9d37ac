"""structlog set-up: key=value lines on stderr by default, JSON lines with ``COLI_LOG=json``.

Without ``COLI_LOG`` only warnings and errors are printed (command output stays clean);
``COLI_LOG=text`` or ``COLI_LOG=json`` shows every state-change event (level ``info``);
``COLI_LOG=off`` silences everything; ``COLI_LOG_LEVEL`` overrides the level.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured = False


def _configure() -> None:
    global _configured
    mode = os.environ.get("COLI_LOG", "").lower()
    default_level = "info" if mode in ("text", "json") else "warning"
    level_name = os.environ.get("COLI_LOG_LEVEL", default_level).upper()
    # structlog only knows the standard levels; "off" filters at CRITICAL and discards the rest
    level = logging.CRITICAL if mode == "off" else getattr(logging, level_name, logging.INFO)
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if mode == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=(structlog.ReturnLoggerFactory() if mode == "off" else _stderr_logger),
        cache_logger_on_first_use=False,
    )
    _configured = True


def _stderr_logger(*_args: Any) -> structlog.PrintLogger:
    # resolved per use, so a replaced sys.stderr (pytest's capture, a daemon's redirect) is honoured
    return structlog.PrintLogger(file=sys.stderr)


def get_logger(name: str) -> Any:
    """A lazy structlog logger bound to ``component=name``; follows :func:`reconfigure`."""
    if not _configured:
        _configure()
    return structlog.get_logger(component=name)


def reconfigure() -> None:
    """Re-read ``COLI_LOG`` (tests and the CLI call this after changing the environment)."""
    _configure()
