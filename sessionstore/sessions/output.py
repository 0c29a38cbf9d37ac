"""A turn's output as it is sampled, one processor for every front end (``coli-kv generate`` and
``chat``, a session's conversation, the HTTP service): the tokens, the text decoded incrementally,
the stop strings (text that could begin one is held back, a completed one ends the text before it),
every eos id, a caller's request to stop, and why the turn ended.

A turn ends at a token boundary: :meth:`OutputProcessor.on_token` raises :class:`TurnStop` after
the token that ends it has been recorded, and the caller catches it (and commits what the session
holds). A turn that runs to its ``max_new`` tokens ends without it (``end`` stays
:attr:`TurnEnd.LENGTH`). Why a turn ended is that one field, a :class:`TurnEnd`, everywhere; the
wire's spellings (OpenAI's ``finish_reason``, the CLI's ``stopped``) are derived from it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the text extra (tokenizers) is imported only where there is text
    from kernels.model.text import ChatTokenizer, StreamDecoder


class TurnEnd(StrEnum):
    """Why a turn ended, the one field every result carries (a str: it compares and prints as its value)."""

    LENGTH = "length"  # its max_new tokens
    EOS = "eos"  # an eos id
    STOP = "stop"  # a stop string
    ABORT = "abort"  # the caller: a vanished client, a stopping server, Ctrl-C

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish_reason: "stop" (an eos id or a stop string), "length", or "abort"."""
        return "stop" if self in (TurnEnd.EOS, TurnEnd.STOP) else self.value

    @property
    def stopped(self) -> str:
        """The CLI's reply field: "eos", "limit" (max_new) or "interrupted" (a stop string, the caller)."""
        return {TurnEnd.EOS: "eos", TurnEnd.LENGTH: "limit"}.get(self, "interrupted")


REASONS = tuple(end.value for end in TurnEnd)  # every spelling of TurnEnd


class TurnStop(Exception):
    """Raised from the per-token callback to end a turn; ``end``: EOS, STOP or ABORT."""

    def __init__(self, end: TurnEnd | str) -> None:
        super().__init__(TurnEnd(end).value)
        self.end = TurnEnd(end)


class StopStrings:
    """Streamed text through the stop strings: what cannot begin one goes out at once, a possible
    beginning is held back, a completed one ends the text before it (``hit``)."""

    def __init__(self, stops: Sequence[str], emit: Callable[[str], None] | None) -> None:
        self.stops, self.emit = list(stops), emit
        self.emitted = ""
        self.held = ""
        self.hit = False

    def push(self, piece: str) -> None:
        if self.hit or not piece:
            return
        if not self.stops:  # nothing can begin a stop string: the piece goes out as it is
            self._emit(piece)
            return
        buf = self.held + piece
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self._emit(buf[:min(found)])
            self.held, self.hit = "", True
            return
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._emit(buf[:len(buf) - keep])
        self.held = buf[len(buf) - keep:]

    def flush(self) -> None:
        """The end of the text: what was held back goes out (unless a stop string was hit)."""
        if not self.hit:
            self._emit(self.held)
        self.held = ""

    def _emit(self, text: str) -> None:
        if text:
            self.emitted += text
            if self.emit is not None:
                self.emit(text)


class OutputProcessor:
    """One turn's output: ``on_token`` is the session's per-token callback; ``finish`` ends the text.

    ``eos``: the ids that end the turn (empty: sample on past them); ``tokenizer``: decode the text
    as it comes (None: tokens only); ``stops``: stop strings; ``on_text``: where each piece of text
    that passed the stop strings goes; ``should_abort``: asked after every token, True ends the turn
    ("abort": a vanished client, a stopping server, Ctrl-C)."""

    def __init__(self, *, eos: frozenset[int] = frozenset(), tokenizer: ChatTokenizer | None = None,
                 stops: Sequence[str] = (), on_text: Callable[[str], None] | None = None,
                 should_abort: Callable[[], bool] | None = None) -> None:
        self.eos = eos
        self.tokens: list[int] = []
        self.end = TurnEnd.LENGTH
        self.stream: StreamDecoder | None = None
        if tokenizer is not None:
            from kernels.model.text import StreamDecoder  # only with a tokenizer: the text extra is there

            self.stream = StreamDecoder(tokenizer)
        self.gate = StopStrings(stops, on_text)
        self.should_abort = should_abort

    def on_token(self, token: int, position: int) -> None:
        """Record ``token`` (sampled for ``position``); raise :class:`TurnStop` if it ends the turn."""
        self.tokens.append(int(token))
        if self.stream is not None:
            self.gate.push(self.stream.push(token))
        if token in self.eos:
            self._stop(TurnEnd.EOS)
        if self.gate.hit:
            self._stop(TurnEnd.STOP)
        if self.should_abort is not None and self.should_abort():
            self._stop(TurnEnd.ABORT)

    def finish(self) -> str:
        """The rest of the decoded text through the stop strings; the text the turn emitted."""
        if self.stream is not None:
            self.gate.push(self.stream.finish())
        self.gate.flush()
        return self.gate.emitted

    @property
    def text(self) -> str:
        """The text emitted so far (stop strings applied)."""
        return self.gate.emitted

    @property
    def decoded(self) -> str:
        """Every token's text so far, stop strings not applied (empty without a tokenizer)."""
        return self.stream.text if self.stream is not None else ""

    def _stop(self, end: TurnEnd) -> None:
        self.end = end
        raise TurnStop(end)


@dataclass
class TurnReply:
    """What one turn gave, the one result of every turn (:func:`~.turn.run_turn`'s and ``Session.generate``'s):
    its tokens, its text (stop strings applied; empty for ``Session.generate``, which has no
    tokenizer), why it ended, its prompt's length and the prefix of it a session reused, and a
    session's committed records after it (None without a session). ``Session.generate`` also says
    how many tokens it fed (the prompt's rest or the pending token), how many commits it ran and
    how long it took (0 where a turn does not count them)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    end: TurnEnd = TurnEnd.LENGTH
    prompt_tokens: int = 0
    reused_prefix: int = 0
    committed: int | None = None
    fed: int = 0
    commits: int = 0
    seconds: float = 0.0

    @property
    def stopped(self) -> str:
        """The CLI's spelling of :attr:`end` ("eos", "limit", "interrupted")."""
        return self.end.stopped

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "text": self.text, "stopped": self.stopped,
                "prompt_tokens": self.prompt_tokens, "reused_prefix": self.reused_prefix}


__all__ = ["REASONS", "OutputProcessor", "StopStrings", "TurnEnd", "TurnReply", "TurnStop"]
