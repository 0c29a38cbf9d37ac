"""One turn as the engine thread runs it: a chat reply or a text completion, on a session or
stateless, streamed piece by piece into a :class:`TurnSink` and ended at a token boundary by eos,
``max_tokens``, a stop string, a vanished client or a shutdown.

On a session, chat turns go through its :class:`Conversation` (the whole ``messages`` list is
rendered and prefix-matched against the history; the conversation file stays consistent) and
completion turns through ``Session.generate`` (the prompt ids are the whole history; the
conversation file, which no longer describes the tokens, is removed first). Every ending commits.
Every kind is :func:`sessionstore.sessions.run_turn`, its reply turned into the wire's outcome here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kernels.errors import FormatError
from kernels.model.cache_pool import CachePool
from kernels.model.logits import TokenLogprob, TurnDraw
from kernels.model.sampling import Sampler
from kernels.model.text import ChatTokenizer
from kernels.model.text.grammar import GrammarCompiler, GrammarError, TokenGrammar
from sessionstore.service.engine.durable_stream import durable_sink
from sessionstore.service.errors import ApiError
from sessionstore.service.wire import PromptRenderer, TurnOutcome, TurnSpec
from sessionstore.sessions import (
    CONVERSATION_NAME,
    DecodeDriver,
    OutputProcessor,
    Session,
    TurnReply,
    TurnStop,
    remove_record,
    run_turn,
)
from sessionstore.sessions.conversation_chat import Conversation, check_room


class TurnSink(Protocol):
    """Where a turn's text goes (with the log-probabilities of the tokens drawn since the last
    piece, when the turn asked for them), and whether its client still listens."""

    def text(self, piece: str, logprobs: list[TokenLogprob] | None = None) -> None: ...
    def cancelled(self) -> bool: ...


def sampler_for(given: dict[str, Any]) -> Sampler:
    """One request's settings: the defaults (greedy, no logits processing) with the fields it gave
    (checked by the sampler's rules); never what a session's manifest holds from an earlier request
    or the CLI."""
    return Sampler.checked(**given)


@dataclass(frozen=True)
class Admitted:
    """A turn's prompt as it enters the core (:meth:`TurnRunner.admit`), checked there once: its
    ids against the vocabulary, they and ``max_new`` new tokens against the context."""

    ids: list[int]
    max_new: int


def max_new_for(spec: TurnSpec, prompt_len: int, context: int, default: int) -> int:
    """``max_tokens``, or the default clamped to the room the context leaves; checked against it."""
    max_new = spec.max_tokens if spec.max_tokens is not None else max(1, min(default, context - prompt_len + 1))
    check_room(range(prompt_len), max_new, context)  # a range: the length is all it reads
    return max_new


class EndingOutput(OutputProcessor):
    """A turn's output that calls ``on_end`` once, when the turn's last token is drawn (its ``max_new``-th,
    or one that ends it: eos, a stop string, an abort), before its commit."""

    def __init__(self, max_new: int, on_end: Callable[[], None], **kw: Any) -> None:
        super().__init__(**kw)
        self.max_new, self.on_end = max_new, on_end

    def on_token(self, token: int, position: int) -> None:
        try:
            super().on_token(token, position)
        except TurnStop:
            self.on_end()
            raise
        if len(self.tokens) == self.max_new:
            self.on_end()


class TurnRunner:
    """Runs turns for one model (and its tokenizer, None for a model without text files).

    ``at_token()`` is called at every token boundary (the engine hands the decoder on there) and
    answers whether the server is stopping; a stopping server or a vanished client ends the turn."""

    def __init__(self, model: Any, tokenizer: ChatTokenizer | None, kv_dtype: str, default_max_tokens: int,
                 drive: DecodeDriver | None = None) -> None:
        self.model, self.tok, self.kv_dtype = model, tokenizer, kv_dtype
        self.drive = drive  # runs a stateless turn's sampling loop (the engine thread), else inline
        self.default_max_tokens = default_max_tokens
        self.context = int(model.config.max_position_embeddings)
        self.eos = frozenset(tokenizer.eos_ids if tokenizer is not None else model.config.eos_token_ids)
        self._grammars: GrammarCompiler | None = None  # made on the first structured request
        self.renderer = PromptRenderer(tokenizer)
        self.caches = CachePool(lambda: model.new_cache(kv_dtype))  # stateless turns' caches, reused

    def _text_tokenizer(self, what: str) -> ChatTokenizer:
        return self.renderer.text_tokenizer(what)

    def prompt_ids(self, spec: TurnSpec) -> list[int]:
        """The turn's prompt ids: as the API process rendered them, else rendered here; checked
        against the vocabulary."""
        ids = spec.prompt_ids if spec.prompt_ids is not None else \
            self.renderer.prompt_ids(spec.kind, spec.messages, spec.prompt)
        if not ids:
            raise FormatError("the prompt tokenizes to nothing")
        checked: list[int] = self.model.check_tokens(np.asarray(ids, dtype=np.int64)).tolist()  # one C pass
        return checked

    def admit(self, spec: TurnSpec) -> Admitted:
        """The turn's prompt ids and how many tokens it may add, checked (vocabulary, context) where
        they enter the core: the tiers, a stored response's placing and the turn all take these."""
        ids = self.prompt_ids(spec)
        return Admitted(ids, max_new_for(spec, len(ids), self.context, self.default_max_tokens))

    # ---- the turn's draw and output ---------------------------------------------------------------
    def _output(self, spec: TurnSpec, draw: TurnDraw, sink: TurnSink, at_token: Callable[[], bool],
                ending: tuple[int, Callable[[], None]] | None = None) -> OutputProcessor:
        """The turn's output processor: eos ends it unless ``ignore_eos``, the request's stop
        strings, text to the sink (with the log-probabilities of the tokens drawn since the last
        piece, when asked for), a stopping server or a vanished client aborts it. ``ending``:
        ``(max_new, on_end)``, ``on_end`` called when its last token is drawn (:class:`EndingOutput`)."""
        sent = 0

        def with_logprobs(piece: str) -> None:
            nonlocal sent
            fresh, sent = draw.logprobs[sent:], len(draw.logprobs)
            sink.text(piece, fresh)

        on_text = sink.text if spec.top_logprobs is None else with_logprobs
        kw: dict[str, Any] = {"eos": frozenset() if spec.ignore_eos else self.eos, "tokenizer": self.tok,
                              "stops": spec.stops, "on_text": on_text,
                              "should_abort": lambda: at_token() or sink.cancelled()}
        return OutputProcessor(**kw) if ending is None else EndingOutput(*ending, **kw)

    def _draw(self, spec: TurnSpec) -> TurnDraw:
        """The turn's draw: the request's settings (:func:`sampler_for`; ``min_tokens`` bans the eos
        ids that would end it), log-probabilities if asked, its ``response_format``'s grammar."""
        return TurnDraw(sampler_for(spec.sampling), stop_ids=frozenset() if spec.ignore_eos else self.eos,
                        top_logprobs=spec.top_logprobs, constraint=self._grammar(spec))

    def _grammar(self, spec: TurnSpec) -> TokenGrammar | None:
        """A fresh grammar for ``spec.response_format`` (None: free text); a schema that cannot be
        enforced is a 400 naming what (``unsupported_schema``)."""
        if spec.response_format is None or spec.response_format.get("type") in (None, "text"):
            return None
        tok = self._text_tokenizer("response_format")
        try:
            if self._grammars is None:
                self._grammars = GrammarCompiler(tok, int(self.model.config.vocab_size))
            return self._grammars.compile(spec.response_format)
        except GrammarError as exc:
            raise ApiError(400, str(exc), param="response_format", code="unsupported_schema") from None

    @staticmethod
    def _outcome(spec: TurnSpec, draw: TurnDraw, reply: TurnReply) -> TurnOutcome:
        """The wire's outcome of ``reply`` (OpenAI's finish_reason from its end; the log-probabilities
        of its tokens when the turn asked for them)."""
        return TurnOutcome(reply.tokens, reply.text, reply.end.finish_reason, reply.prompt_tokens,
                           reply.reused_prefix, reply.committed,
                           logprobs=None if spec.top_logprobs is None else list(draw.logprobs))

    # ---- on a session --------------------------------------------------------------------------
    def on_session(self, session: Session, spec: TurnSpec, sink: TurnSink, at_token: Callable[[], bool],
                   admitted: Admitted, on_end: Callable[[], None] | None = None) -> TurnOutcome:
        """One turn on ``session``; ``on_end`` called once its last token is drawn (before its commit)."""
        with durable_sink(session, sink) as turn_sink:  # --durable-stream: text once committed
            return self._on_session(session, spec, turn_sink, at_token, admitted, on_end)

    def _on_session(self, session: Session, spec: TurnSpec, sink: TurnSink, at_token: Callable[[], bool],
                    admitted: Admitted, on_end: Callable[[], None] | None) -> TurnOutcome:
        prompt, max_new = admitted.ids, admitted.max_new
        draw = self._draw(spec)
        output = self._output(spec, draw, sink, at_token, None if on_end is None else (max_new, on_end))
        if spec.kind == "chat":
            conv = Conversation.open(session, self._text_tokenizer("chat"))
            structured = draw.constraint is not None
            reply = conv.respond(spec.messages or [], max_new, sampler=draw, prompt=prompt, output=output,
                                 response_format=spec.response_format if structured else None)
            return self._outcome(spec, draw, reply)
        if not session.files.being_made:  # a new session's files being made hold no conversation file
            if session.files.check is not None and (session.directory / CONVERSATION_NAME).exists():
                session.ensure_resident()  # nothing is removed before a checksum pass beside has passed
            session.run_io(lambda: remove_record(session.directory))  # before the tokens change: never a stale
            # conversation (a durable unlink: the server's I/O thread runs it while its loop steps the others)
        return self._outcome(spec, draw, run_turn(output, max_new, draw, prompt=prompt, session=session))

    # ---- stateless ----------------------------------------------------------------------------
    def stateless(self, spec: TurnSpec, sink: TurnSink, at_token: Callable[[], bool],
                  admitted: Admitted) -> TurnOutcome:
        """A turn in an empty in-memory cache (a pooled one, wiped: :class:`CachePool`; no session,
        nothing stored)."""
        draw = self._draw(spec)
        output = self._output(spec, draw, sink, at_token)
        cache = self.caches.take()  # wiped, its address tables kept (no new arrays, no new tables)
        reply = run_turn(output, admitted.max_new, draw, prompt=admitted.ids, model=self.model,
                         cache=cache, drive=self.drive)
        self.caches.give_back(cache)  # the turn returned: nothing refers to it (one that raised drops it)
        return self._outcome(spec, draw, reply)


__all__ = ["Admitted", "EndingOutput", "TurnRunner", "TurnSink", "max_new_for", "sampler_for"]
