"""The engine core: its own process (``python -m sessionstore.service.engine.process``), which owns
the decoder and every resident session and runs each request's work as a job on one loop.

- ``engine`` (:class:`Engine`: the open sessions, which of them are resident, and what a request
  may ask of them, run as jobs on the engine loop of :mod:`sessionstore.service.steps`), ``turns`` (:class:`TurnSpec`,
  :class:`TurnRunner`: one turn, prompt to reply), ``durable_stream`` (text held back until the
  commit covering it);
- ``process`` (the process: sockets, the outbox, start-up) and ``operations`` (the named
  operations a :class:`~sessionstore.service.engine.ipc.Call` may ask), ``response_job`` (a
  Responses API turn), ``conversations`` (the Conversations API: a conversation is a session),
  and what only the core runs: ``tiers`` (the tier manager and sweeper),
  ``fencing``, ``messages``, ``listing``, ``tier_fields``, ``response_records``, ``metrics``;
- ``ipc`` (the messages between the API process and the core) and ``prompts`` (the template
  renderer and tokenizer). Both processes load them; they live here because the messages are built
  on the core's request types (:class:`TurnSpec`, :class:`TurnOutcome`), and the API process, the
  room above, imports them through this surface. The fleet, below, needs neither.

This room sits above the floor (``sessionstore.service``), ``steps`` and ``fleet``, and below
``http``; its modules import the service extra (msgspec, pyzmq, prometheus_client), so this surface
does too. It leaves out ``process``: that module is run with ``python -m``, and a package that
imported that module before ``runpy`` ran it would hold two copies of it.
"""
from sessionstore.service.engine.conversations import (
    conversation_not_found,
    is_session_id,
    new_conversation_id,
)
from sessionstore.service.engine.engine import Engine
from sessionstore.service.engine.ipc import (
    Call,
    Cancel,
    CoreConfig,
    Drain,
    ErrorInfo,
    Failed,
    FromCore,
    Piece,
    Ready,
    ResponseJob,
    Result,
    StartFailed,
    ToCore,
    TurnCall,
    TurnDone,
    decode_from_core,
    decode_to_core,
    encode_message,
    socket_paths,
)
from sessionstore.service.engine.listing import PageQuery, page_query
from sessionstore.service.engine.metrics import EngineMetrics
from sessionstore.service.engine.prompts import PromptRenderer, load_tokenizer
from sessionstore.service.engine.response_records import (
    ResponseRecord,
    ResponseRecords,
    chain_session_id,
    finish_record,
    is_response_id,
    new_response_id,
    parse_record,
)
from sessionstore.service.engine.tiers import DEFAULT_SWEEP_INTERVAL_S, Sweeper, TierManager
from sessionstore.service.engine.turns import TurnOutcome, TurnRunner, TurnSink, TurnSpec

__all__ = ["Call", "Cancel", "CoreConfig", "DEFAULT_SWEEP_INTERVAL_S", "Drain", "Engine", "EngineMetrics", "ErrorInfo",
           "Failed", "FromCore", "PageQuery", "Piece", "PromptRenderer", "Ready", "ResponseJob", "ResponseRecord",
           "ResponseRecords", "Result", "StartFailed", "Sweeper", "TierManager", "ToCore", "TurnCall", "TurnDone",
           "TurnOutcome", "TurnRunner", "TurnSink", "TurnSpec", "chain_session_id", "conversation_not_found",
           "decode_from_core",
           "decode_to_core", "encode_message", "finish_record", "is_response_id", "is_session_id", "load_tokenizer",
           "new_conversation_id", "new_response_id", "page_query", "parse_record", "socket_paths"]
