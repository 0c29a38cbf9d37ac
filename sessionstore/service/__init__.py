"""The long-running server: one engine thread over the decoder and the open sessions, an
OpenAI-compatible HTTP API (chat and text completions, streamed as server-sent events), the
sessions API, health and Prometheus metrics, bearer-key auth. Imports the rooms below it
(sessions, migration and, for two helpers, kvfile) and kernels; nothing below imports it.

The package itself imports no web stack (the ``service`` extra: starlette, uvicorn, pydantic,
prometheus_client); :mod:`~sessionstore.service.server` (``serve_http``), ``app`` (``build_app``)
and ``engine`` (``Engine``) do.
"""
from sessionstore.service.bind import (
           API_KEY_ENV,
           DEFAULT_HOST,
           PULL_KEY_ENV,
           check_bind,
           is_loopback_address,
           is_loopback_host,
           parse_bind,
)
from sessionstore.service.errors import ApiError, api_error_of
from sessionstore.service.limits import ServiceLimits

__all__ = ["API_KEY_ENV", "ApiError", "DEFAULT_HOST", "PULL_KEY_ENV", "ServiceLimits", "api_error_of", "check_bind",
           "is_loopback_address", "is_loopback_host", "parse_bind"]
