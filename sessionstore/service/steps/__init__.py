"""The engine loop and its batched steps: one thread that runs each request's work as a job (a
greenlet on the loop's thread), batches every waiting forward into one ``model.step``, paces prompt
chunks beside decoding sessions and starts a step's mid-turn commits together.

- ``loop`` (:class:`EngineLoop`: the thread, its jobs and what they may wait for; :class:`LoopDecoder`:
  the model as jobs see it), ``batched_step`` (one step of every waiting forward),
  ``prefill_pacer`` (how much prompt a step carries), ``group_commit`` (a step's mid-turn commits).

The engine core (``engine``) runs on it when serving, and ``coli-kv chat`` and ``generate`` in
process; so this room imports no optional extra (greenlet is a base dependency), only the rooms of
sessionstore below the service. It sits above the floor and below ``fleet``, ``engine`` and ``http``.
"""
from sessionstore.service.steps.group_commit import GroupCommit
from sessionstore.service.steps.loop import GATHER_S, IO_THREADS, EngineLoop, LoopDecoder
from sessionstore.service.steps.prefill_pacer import MAX_PREFILL_TOKENS, PREFILL_STEP_RATIO, PrefillPacer

__all__ = ["GATHER_S", "IO_THREADS", "MAX_PREFILL_TOKENS", "PREFILL_STEP_RATIO", "EngineLoop", "GroupCommit",
           "LoopDecoder", "PrefillPacer"]
