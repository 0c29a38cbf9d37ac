"""The engine core in this process, for one ``coli-kv chat`` or ``generate`` command: the same
engine loop as ``serve --http`` (:class:`~sessionstore.service.steps.loop.EngineLoop`), without
the API process, its IPC or the service's other extras.

The command's model is loaded once and the loop started over it; the store's sessions decode
through a :class:`~sessionstore.service.steps.loop.LoopDecoder` and are opened with the loop's
``decode_driver`` and ``commit_runner`` (:meth:`InProcessCore.session_options`), as the
service's ``Engine`` opens them. The command's session work runs as jobs on the loop
(:meth:`InProcessCore.call`): its forwards are the loop's batched steps, its decode loop is run by
the loop between steps, its commits go through the loop's commit runner. A served turn and a CLI
turn take the same path, token for token.

The command's own thread only waits: a job's error is raised there (one line, as before), a
signal handler it installs (Ctrl-C ending a reply) sets a flag the job reads at its next token.
The loop's threads are daemons and :meth:`InProcessCore.stop` ends them: a command never hangs on
exit, whatever ended it.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kernels.errors import FormatError, LimitError, NotFoundError

if TYPE_CHECKING:  # the store's classes load with the model, on first use
    from sessionstore.sessions import SessionOptions

T = TypeVar("T")


class InProcessCore:
    """An engine loop over one model, for the jobs of one command."""

    def __init__(self) -> None:
        self.loop: Any = None  # the EngineLoop, once a model is adopted
        self.model: Any = None  # the LoopDecoder the jobs see
        self._decoder: Any = None  # the model it wraps

    # ---- the model --------------------------------------------------------------------------------
    def adopt_decoder(self, decoder: Any) -> Any:
        """Start the loop over ``decoder`` (a loaded model); the model jobs decode through
        (a :class:`LoopDecoder`, every forward a part of the loop's batched steps)."""
        from sessionstore.service.steps import EngineLoop, LoopDecoder  # greenlet: jobs are continuations

        if self.loop is not None:
            if decoder is not self._decoder and decoder is not self.model:
                raise FormatError("one command decodes with one model: this one already runs another")
            return self.model
        self._decoder = decoder
        self.loop = EngineLoop(decoder)
        self.model = LoopDecoder(decoder, self.loop)
        return self.model

    def adopt_store_model(self, store: Any, source: Any) -> None:
        """Load the model at ``source`` through ``store`` and have the store's sessions of it
        decode through the loop (``SessionStore.adopt_model``, as the service's ``Engine`` does).
        A model that cannot be found is left alone: opening the session then says so, naming it."""
        if source is None:
            return
        try:
            decoder, _ = store.load_model(source)
        except (NotFoundError, FileNotFoundError):
            return
        store.adopt_model(source, self.adopt_decoder(decoder))

    def session_options(self, options: SessionOptions) -> SessionOptions:
        """``options`` for a session opened for the loop's jobs: with the loop's decode driver and
        commit runner (unchanged before a model is adopted: the session then decodes inline, as before)."""
        if self.loop is None:
            return options
        return replace(options, decode_driver=self.loop.drive_decode, commit_runner=self.loop.run_commit)

    # ---- jobs -------------------------------------------------------------------------------------
    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run as a job on the loop (here, before a model is adopted); its value, or its
        error raised here. One job at a time: a job submitted while an earlier one still runs
        (left by a Ctrl-C) waits for it, so two never interleave on a session."""
        if self.loop is None:
            return fn()
        self.loop.wait_idle()
        future: concurrent.futures.Future[T] = self.loop.submit(fn)
        try:
            return future.result()
        except KeyboardInterrupt:  # Ctrl-C outside a reply: the job ends first (it holds the session)
            concurrent.futures.wait([future])
            raise

    def stateless_turn(self, cache: Any, prompt: list[int], max_new: int, sampler: Any, output: Any) -> Any:
        """A turn in an in-memory ``cache`` (no session), as a job: ``prompt`` fed in the loop's
        batched steps, then at most ``max_new`` tokens drawn by the loop among its running turns (as a
        served stateless turn), each through ``output`` (an ``OutputProcessor``: its eos ids, text and
        stops end the turn). The turn's ``TurnReply`` (:func:`sessionstore.sessions.run_turn`)."""
        from sessionstore.sessions import run_turn

        assert self.loop is not None, "adopt_decoder first"
        model = self.model
        ids = model.check_tokens(np.asarray(prompt, dtype=np.int64).reshape(-1))  # [P] i32
        if ids.size == 0:
            raise FormatError("the prompt is empty: at least one token must be fed to get next-token logits")
        end = cache.length + ids.size + max(max_new - 1, 0)  # the last token drawn is never fed
        if end > model.config.max_position_embeddings:
            raise LimitError(f"{cache.length} cached + {ids.size} prompt + {max_new} new tokens exceed the model's"
                             f" context of {model.config.max_position_embeddings} positions")
        return self.call(lambda: run_turn(output, max_new, sampler, prompt=ids.tolist(), model=model, cache=cache,
                                          drive=self.loop.drive_decode))

    def stop(self) -> None:
        """Stop the loop once its jobs have ended (idempotent)."""
        if self.loop is not None:
            self.loop.stop()

    def __enter__(self) -> InProcessCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["InProcessCore"]
