"""One turn, for every front end: the server's turns (on a session or stateless), the CLI's
(``coli-kv generate`` and ``chat``) and the reference runs (:class:`~.conversation_chat.ReferenceChat`)
all run :func:`run_turn` and read its one result, a :class:`TurnReply`, whose ``end`` (a
:class:`~.output.TurnEnd`) is the one field that says why the turn ended.

A turn's tokens go through its :class:`~.output.OutputProcessor` (the text, the stop strings, the eos
ids, a caller's request to stop), which ends it at a token boundary (:class:`~.output.TurnStop`); on
a session, that ending commits what the session holds by the session's ``run_io`` (a server's I/O
thread), as a turn that ran to its ``max_new`` tokens commits inside the session's ``generate``.

:func:`run_turn` trusts its caller: a turn's ids and its room in the context were checked once, where
they entered (the server's core, ``TurnRunner.admit``; the CLI; a library's caller goes through
``Session.generate``, which checks them).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels.model.logits import TurnDraw
from kernels.model.sampling import Sampler
from sessionstore.sessions.output import OutputProcessor, TurnReply, TurnStop
from sessionstore.sessions.session_turns import generate
from sessionstore.sessions.turn_loop import DecodeDriver, common_prefix, decode_turn


def run_turn(output: OutputProcessor, max_new: int, sampler: Sampler | TurnDraw | None, *,
             prompt: Sequence[int] | None = None, session: Any = None, keep_sampler: bool = False,
             model: Any = None, cache: Any = None, drive: DecodeDriver | None = None) -> TurnReply:
    """One turn of at most ``max_new`` tokens drawn with ``sampler`` (settings or a :class:`TurnDraw`;
    None: a session's own), each through ``output``.

    On ``session``: :func:`~.session_turns.generate` from ``prompt`` (its prefix shared with the history reused;
    None: on from the pending token), the settings kept in its manifest with ``keep_sampler``; a turn
    that ``output`` ends is committed by the session's ``run_io``. Else in ``cache`` (no store):
    ``prompt`` fed through ``model`` and the tokens drawn, the sampling run by ``drive`` (a server's
    engine loop, among its running turns) or here."""
    reused, committed = 0, None
    if session is not None:
        if prompt is not None:
            session.ensure_resident(keep_check=True)  # a pass beside: awaited by generate, after the first forward
            reused = common_prefix(session.cache.tokens, prompt)
        try:
            generate(session, prompt, max_new, sampler=sampler, keep_sampler=keep_sampler, on_token=output.on_token)
        except TurnStop:  # eos, a stop string, a cancel: the commit's writes and fsyncs by the session's
            session.run_io(session.commits.begin())  # run_io, as every other commit (the loop steps the others)
        committed = session.committed
    else:
        assert model is not None and cache is not None and prompt is not None, "a turn without a session"

        def on_step(token: int, position: int, _logits: np.ndarray) -> None:
            output.on_token(token, position)

        try:
            decode_turn(model, cache, prompt, None, max_new, Sampler() if sampler is None else sampler,
                        on_step=on_step, drive=drive)
        except TurnStop:
            pass
    output.finish()
    return TurnReply(output.tokens, output.text, output.end, len(prompt) if prompt is not None else 0, reused,
                     committed)


__all__ = ["run_turn"]
