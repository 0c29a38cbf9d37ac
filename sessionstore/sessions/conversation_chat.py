"""Conversations over a session: messages in, a streamed reply out, the conversation file kept
consistent with the kv commit.

A reply to ``messages`` (the whole conversation, ending with the new prompt) goes:

1. render ``messages`` with the generation prompt -> prompt ids P; refuse (nothing written) a
   prompt that leaves no room in the model's context for the reply;
2. write the conversation file with the turn OPEN (its messages, len(P), sha256(P)); the
   complete messages before it keep the history they stood for;
3. reuse the longest common prefix k of the committed records and P (truncate there), feed
   P[k:] and COMMIT the kv file: the committed history is now exactly P;
   where ``messages`` continue the conversation's complete messages exactly (its last reply
   as recorded) and the history's ids spell the same text as P's up to a token boundary m
   of P, P is the history + P[m:] instead (:mod:`~.chat_splice`: the reply's ids as
   generated, not as its text re-tokenises; nothing truncated), and the open turn says so
   (``spliced``: how many of P's ids are the history's);
4. sample, streaming text; eos (any of the tokenizer's eos ids), the limit or an interruption
   (checked at each token boundary) ends the turn and the kv file is committed;
5. write the conversation file with the reply appended as an assistant message and the turn
   closed; it names the whole history (records + pending token) by length and digest.

Recovery (:meth:`Conversation.open`), history H = committed records + pending tokens (a
spliced turn's P: H's first ``spliced`` ids + its rendering's ids after them, as in 3):
an open turn whose prompt H starts with is closed with H[len(P):] as the (partial) reply; an
open turn whose prompt never reached the file (H is still the complete messages' history) is
dropped; an open turn cut after its truncation (H a proper prefix of P) has P[len(H):] fed and
committed, then closes with an empty reply. A closed conversation must agree with H exactly.
So after any crash the messages on disk are the ones the committed tokens were rendered from.
The conversation file is read and written by the session's ``run_io`` (a server's I/O thread, while
its engine loop steps the other sessions; :class:`~sessionstore.sessions.session_home.IoRunner`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kernels.errors import ColiError, FormatError, LimitError
from kernels.model.logits import TurnDraw, settings_of
from kernels.model.protocols import Decoder
from kernels.model.sampling import Sampler
from kernels.model.text import ChatTokenizer
from sessionstore.sessions.chat_splice import spelled_end, splice_prompt
from sessionstore.sessions.conversation_file import (
    ConversationRecord,
    OpenTurn,
    check_messages,
    read_record,
    tokens_digest,
    write_record,
)
from sessionstore.sessions.output import OutputProcessor, TurnReply
from sessionstore.sessions.turn import run_turn
from sessionstore.sessions.turn_loop import common_prefix


class ConversationMismatchError(ColiError):
    """A session's conversation file does not describe its committed tokens."""


def fits(prompt: Sequence[int], max_new: int, context: int) -> bool:
    """Whether a turn of ``prompt`` and ``max_new`` new tokens (the last never fed) fits ``context``."""
    return len(prompt) + max(max_new - 1, 0) <= context


def check_room(prompt: Sequence[int], max_new: int, context: int) -> None:
    """Refuse a turn of ``prompt`` and ``max_new`` new tokens (the last never fed) past ``context``."""
    end = len(prompt) + max(max_new - 1, 0)
    if end > context:
        raise LimitError(f"the conversation is {len(prompt)} tokens; with {max_new} new tokens it needs {end} "
                         f"positions, past the model's context of {context}")


class Conversation:
    """A resident :class:`Session` with the messages its tokens were rendered from."""

    def __init__(self, session: Any, tokenizer: ChatTokenizer, record: ConversationRecord) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.record = record
        self.eos = frozenset(tokenizer.eos_ids)
        self.recovered: dict[str, Any] | None = None  # what open() did to an interrupted turn

    # ---- open and recover ------------------------------------------------------------------
    @classmethod
    def open(cls, session: Any, tokenizer: ChatTokenizer) -> Conversation:
        """The session's conversation, recovered to agree with its committed tokens."""
        tokenizer.check_vocab(session.model.config.vocab_size)
        session.ensure_resident()
        # a new session whose files are being made has no conversation file yet
        record = None if session.files.being_made else session.run_io(lambda: read_record(session.directory))
        history = session.history()
        if record is None:  # no messages known: the next reply renders only its own messages
            return cls(session, tokenizer, ConversationRecord([], len(history), tokens_digest(history)))
        conv = cls(session, tokenizer, record)
        if record.turn is not None:
            conv._recover(record.turn, history)
        elif not record.agrees_with(history):
            raise ConversationMismatchError(
                f"session {session.id!r}: its conversation stands for {record.tokens} tokens that are not its "
                f"{len(history)} committed tokens (changed by token-level commands); start a new session")
        return conv

    def _recover(self, turn: OpenTurn, history: list[int]) -> None:
        prompt = self.tokenizer.chat_ids(turn.messages)
        if turn.spliced is not None:  # the prompt was the history's first ids + the rendering's rest
            m = spelled_end(self.tokenizer, history[:turn.spliced], prompt) if len(history) >= turn.spliced else None
            if m is None:
                raise ConversationMismatchError(
                    f"session {self.session.id!r}: the interrupted turn's prompt was spliced onto {turn.spliced} "
                    "tokens that its rendering no longer spells")
            prompt = [*history[:turn.spliced], *prompt[m:]]
        if len(prompt) != turn.prompt_tokens or tokens_digest(prompt) != turn.prompt_digest:
            raise ConversationMismatchError(
                f"session {self.session.id!r}: the interrupted turn no longer renders to the prompt it fed "
                "(another tokenizer or template?)")
        n = len(prompt)
        if len(history) >= n and tokens_digest(history[:n]) == turn.prompt_digest:
            self._close_turn(turn.messages, history[n:], turn.sampler, turn.response_format)
            self.recovered = {"action": "closed", "reply_tokens": history[n:]}
        elif self.record.agrees_with(history):
            self.record.turn = None  # the prompt never reached the kv file
            self._write_record()
            self.recovered = {"action": "dropped", "reply_tokens": []}
        elif len(history) < n and history == prompt[:len(history)]:
            self.session.append_tokens(prompt[len(history):], commit=True)
            self._close_turn(turn.messages, [], turn.sampler, turn.response_format)
            self.recovered = {"action": "completed", "reply_tokens": []}
        else:
            raise ConversationMismatchError(
                f"session {self.session.id!r}: its committed tokens are neither the conversation's nor its "
                "interrupted turn's")

    def _close_turn(self, messages: list[dict[str, Any]], answer: Sequence[int],
                    sampler: Sampler | None, response_format: dict[str, Any] | None = None) -> str:
        text = self.tokenizer.decode(list(answer))
        history = self.session.history()
        self.record = ConversationRecord([*messages, {"role": "assistant", "content": text}], len(history),
                                         tokens_digest(history), None, sampler, response_format)
        self._write_record()
        return text

    def _write_record(self) -> None:
        """The conversation file, durably (its fsyncs by the session's ``run_io``)."""
        directory, record = self.session.directory, self.record
        self.session.await_files()  # a new session's directory must be there (made while its turn began)
        self.session.run_io(lambda: write_record(directory, record))

    # ---- turns -----------------------------------------------------------------------------
    @property
    def messages(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self.record.messages]

    def respond(self, messages: Sequence[dict[str, Any]], max_new: int, *,
                on_text: Callable[[str], None] | None = None,
                should_stop: Callable[[], bool] | None = None, stop_at_eos: bool = True,
                sampler: Sampler | TurnDraw | None = None, prompt: Sequence[int] | None = None,
                output: OutputProcessor | None = None, response_format: dict[str, Any] | None = None) -> TurnReply:
        """Answer ``messages`` (the whole conversation); the prefix shared with the history is reused.
        ``stop_at_eos`` False samples on past eos ids (to ``max_new`` or an interruption).
        ``sampler``: this turn's settings (or a :class:`TurnDraw` over them), not stored in the
        manifest (None: the manifest's); the conversation file records the settings the reply is
        drawn with (FORMAT.md 5.8). ``prompt``: the
        ids ``messages`` render to with the generation prompt, when the caller rendered them (a
        request's prompt is rendered and tokenised once): the caller checked them (against the
        vocabulary, and their room in the context) where they entered; else they are rendered here
        and their room checked here.
        ``output``: the turn's output processor, when the caller builds its own (stop strings, a
        client that may vanish); else one from ``on_text``, ``should_stop`` and ``stop_at_eos``.
        ``response_format``: the grammar the caller's ``sampler`` (a TurnDraw) constrains the reply
        to, recorded with the turn (FORMAT.md 5.8); None: free text."""
        checked = check_messages(list(messages), "messages")
        if not checked:
            raise FormatError("the conversation is empty: give at least one message")
        session, model = self.session, self.session.model
        if prompt is None:  # rendered here: the tokenizer's ids are the model's (``check_vocab`` at open);
            prompt = self.tokenizer.chat_ids(checked, add_generation_prompt=True)  # their room is checked
            check_room(prompt, max_new, model.config.max_position_embeddings)  # here, the one check
        prompt = list(prompt)
        session.ensure_resident()
        history = session.history()  # the records' ids + the pending token (the reply's last, not yet fed)
        spliced = None if self.record.turn is not None else splice_prompt(
            self.tokenizer, self.record.messages, checked, history, prompt)
        if spliced is not None and fits(spliced, max_new, model.config.max_position_embeddings):
            prompt = spliced  # the reply's ids as generated, the new messages' ids as rendered: no truncate
        draw = session.manifest.sampler if sampler is None else sampler
        drawn_with = settings_of(draw)
        self.record.turn = OpenTurn(checked, len(prompt), tokens_digest(prompt), drawn_with, response_format,
                                    len(history) if prompt is spliced else None)
        self._write_record()  # the turn is open before its prompt reaches the file
        k = common_prefix(session.cache.tokens, prompt)
        if k < session.cache.length:
            session.truncate(k)
        # the prompt's records are committed before the reply; in durable-stream mode by the commit that
        # covers the first token (a kv commit of the prompt's records with that token pending, or, under
        # commit_every records, a tail commit holding their ids: FORMAT.md 5.5), not by one of their own
        # first: one commit round, not two, before the first piece leaves (a server's turn waited for each)
        session.append_tokens(prompt[k:], commit=not session.options.durable_stream)
        if output is None:
            output = OutputProcessor(eos=self.eos if stop_at_eos else frozenset(), tokenizer=self.tokenizer,
                                     on_text=on_text, should_abort=should_stop)
        reply = run_turn(output, max_new, draw, session=session)  # on from the prompt's pending token
        reply.prompt_tokens, reply.reused_prefix = len(prompt), k
        assert session.history() == [*prompt, *reply.tokens]  # the reply is exactly what was committed
        closed = self._close_turn(checked, reply.tokens, drawn_with, response_format)  # every token's text
        assert closed == output.decoded
        return reply

    def say_all(self, messages: Sequence[dict[str, Any]], max_new: int, **kw: Any) -> TurnReply:
        """:meth:`respond` with ``max_new`` after the messages (the chat's calling order)."""
        return self.respond(messages, max_new, **kw)

    def say(self, text: str, max_new: int, **kw: Any) -> TurnReply:
        return self.respond([*self.record.messages, {"role": "user", "content": text}], max_new, **kw)

    def regenerate(self, max_new: int, **kw: Any) -> TurnReply:
        """Answer the conversation again without its last assistant message."""
        msgs = self.record.messages
        if not msgs or msgs[-1]["role"] != "assistant" or len(msgs) < 2:
            raise FormatError("nothing to regenerate: the conversation does not end with an answer")
        return self.respond(msgs[:-1], max_new, **kw)

    def edit(self, index: int, text: str, max_new: int, **kw: Any) -> TurnReply:
        """Replace user message ``index`` (and drop everything after it), then answer."""
        msgs = self.record.messages
        if not 0 <= index < len(msgs) or msgs[index]["role"] != "user":
            raise FormatError(f"message {index} is not a user message (see /history)")
        return self.respond([*msgs[:index], {**msgs[index], "content": text}], max_new, **kw)

    def fork(self, new_id: str) -> None:
        """Fork the session into ``new_id`` with this conversation (between turns)."""
        self.session.fork(new_id)  # the fork copies the conversation when it describes the copy
        store = self.session.store
        copied = read_record(store.session_dir(new_id))
        if copied is None or not copied.agrees_with(store.history(new_id)):
            raise ConversationMismatchError(f"session {new_id!r} was forked, but its tokens do not match the "
                                            "conversation; it starts without messages")


class ReferenceChat:
    """The uninterrupted run of a conversation: one in-memory cache, no store, no files; the same
    rendering, prefix reuse, feeding and stopping as :class:`Conversation`."""

    def __init__(self, model: Decoder[Any], tokenizer: ChatTokenizer, kv_dtype: str,
                 sampler: Sampler | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.cache = model.new_cache(kv_dtype)
        self.sampler = sampler or Sampler()
        self.eos = frozenset(tokenizer.eos_ids)
        self.held: list[dict[str, Any]] = []  # the messages the cache's tokens stand for (as a record's)
        self.prompt: list[int] = []  # the last turn's prompt (spliced where Conversation splices)
        self.history: list[int] = []

    def respond(self, messages: Sequence[dict[str, Any]], max_new: int) -> list[int]:
        checked = check_messages(list(messages), "messages")
        prompt = self.tokenizer.chat_ids(checked, add_generation_prompt=True)
        spliced = splice_prompt(self.tokenizer, self.held, checked, self.history, prompt)
        if spliced is not None and fits(spliced, max_new, self.model.config.max_position_embeddings):
            prompt = spliced
        k = common_prefix(self.cache.tokens, prompt)
        if k < self.cache.length:
            self.cache.truncate(k)
        self.prompt = prompt
        tokens = run_turn(OutputProcessor(eos=self.eos), max_new, self.sampler, prompt=prompt[k:], model=self.model,
                          cache=self.cache).tokens
        self.held = [*checked, {"role": "assistant", "content": self.tokenizer.decode(tokens)}]
        self.history = [*prompt, *tokens]  # the cache's ids + the reply's last token (not yet fed)
        return tokens


__all__ = ["Conversation", "ConversationMismatchError", "ReferenceChat", "check_room", "fits"]
