"""The http room: the API process of ``coli-kv serve --http``.

OpenAI-compatible completions and the Responses API, the sessions API, health and metrics, auth,
the JSON body reader, slow-client timeouts, the web page, and the client of the engine core
(:mod:`~sessionstore.service.http.core_client`: requests sent as data over IPC, events routed back
to the handlers). Handlers validate, render and tokenise a prompt once, send the work to the core
and stream what comes back; they never touch a session's files (a bundle's bytes in transfer are
the fleet room's).

The top room of the service: it imports the engine core's surface (its request types, the IPC
messages, the prompt renderer), the fleet room and the service's floor; nothing imports it but the
CLI. Importing it imports the web stack (the ``service`` extra).
"""
from sessionstore.service.http.server import ServeConfig, serve_http

__all__ = ["ServeConfig", "serve_http"]
