"""The long-running server (``coli-kv serve --http``): two processes, in rooms by job.

- ``http/``: the API process: the OpenAI-compatible API, the sessions API, auth, the web page,
  metrics; renders and tokenises each prompt once and sends the work to the engine core as data.
- ``engine/``: the engine core, its own process (``python -m sessionstore.service.engine.process``):
  the decoder (run on the ``steps`` loop), commits and the resident
  sessions, tiers and response records. ``ipc`` (the messages between the two processes, built on
  the core's request types) and ``prompts`` (the template renderer and tokenizer both processes
  load) sit in it; ``http`` imports them through the engine's surface.
- ``steps/``: the engine loop (each request's work a job on one thread, batched steps, prefill
  pacing, group commit); no optional extra: ``coli-kv chat`` and ``generate`` run on it in process.
- ``fleet/``: leases and this host's place in a fleet, ``--fleet-proxy``, bundles in transfer.
- The floor, this package's surface: where to listen (``bind``), errors in OpenAI's shape
  (``errors``), the named limits (``limits``).

Each imports only downward: floor < ``steps`` < ``fleet`` < the engine core < ``http``; below them all, the
rooms of sessionstore (kvfile, sessions, migration) and kernels; nothing below imports the service.
This package itself imports no optional extra; ``http`` imports the web stack (the ``service``
extra) and ``engine`` the core's part of it (greenlet, pyzmq, msgspec, prometheus_client).
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
