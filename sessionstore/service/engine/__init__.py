"""The engine core: its own process (``python -m sessionstore.service.engine.process``), which owns
the decoder and every resident session and runs each request's work as a job on one loop.

- ``engine`` (:class:`Engine`: the open sessions, which of them are resident, and what a request
  may ask of them, run as jobs on the engine loop of :mod:`sessionstore.service.steps`), ``turns``
  (:class:`TurnRunner`: one turn, prompt to reply), ``durable_stream`` (text held back until the
  commit covering it);
- ``process`` (the process: sockets, the outbox, start-up) and ``operations`` (the named
  operations a :class:`~sessionstore.service.wire.ipc.Call` may ask), ``response_job`` (a
  Responses API turn), ``conversations`` (the Conversations API: a conversation is a session),
  and what only the core runs: ``tiers`` (the tier manager and sweeper),
  ``fencing``, ``fleet_hooks``, ``messages``, ``tier_fields``, ``session_responses``, ``metrics``;
- what both processes speak (the request types, the IPC messages, the prompt renderer) is the
  wire room's (:mod:`sessionstore.service.wire`): the API process imports that, never this room.

This room sits above the floor (``sessionstore.service``), ``steps``, ``fleet`` and ``wire``, and
below ``http`` (which does not import it); its modules import the service extra (msgspec, pyzmq,
prometheus_client), so this surface does too. It leaves out ``process``: that module is run with
``python -m``, and a package that imported that module before ``runpy`` ran it would hold two
copies of it.
"""
from sessionstore.service.engine.engine import Engine
from sessionstore.service.engine.metrics import EngineMetrics
from sessionstore.service.engine.tiers import Sweeper, TierManager
from sessionstore.service.engine.turns import TurnRunner, TurnSink

__all__ = ["Engine", "EngineMetrics", "Sweeper", "TierManager", "TurnRunner", "TurnSink"]
