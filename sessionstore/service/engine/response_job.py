"""A stored Responses turn as the engine core runs it (FORMAT.md 7.6): place the turn on its
chain's session, run it, write its record (made visible once the session is free: ``publish``).

The turn continues the previous response's session in place when that session still ends at the
response's checkpoint (its newest response); else it forks the session at the longest prefix its
tokens share with this turn's prompt (an older response: a branch), or starts a new session when
they share none or the session is gone. A refused turn leaves no new session behind.
"""
from __future__ import annotations

import msgspec

from kernels.errors import ColiError
from sessionstore.log import get_logger
from sessionstore.service.engine.conversations import conversation_messages, read_state, save_turn
from sessionstore.service.engine.engine import Engine
from sessionstore.service.engine.session_responses import FleetResponses, keep_with_session
from sessionstore.service.engine.turns import TurnSink
from sessionstore.service.errors import ApiError
from sessionstore.service.wire import (
    ResponseJob,
    ResponseRecord,
    ResponseRecords,
    TurnOutcome,
    TurnSpec,
    chain_session_id,
    finish_record,
)
from sessionstore.sessions import Session, common_prefix, tokens_digest

log = get_logger("service")


class StoredResponseTurn:
    """One stored response's turn on ``engine`` (run as the engine's work, ``spec.session`` claimed)."""

    def __init__(self, engine: Engine, records: ResponseRecords, spec: TurnSpec, job: ResponseJob,
                 fleet: FleetResponses | None = None) -> None:
        self.engine, self.records, self.spec, self.fleet = engine, records, spec, fleet
        self.record = msgspec.convert(job.record, ResponseRecord)
        self.chain = job.chain
        self.previous = None if job.previous is None else msgspec.convert(job.previous, ResponseRecord)
        self.conversation, self.store = job.conversation, job.store

    def on_conversation(self, sid: str) -> None:
        """Run on conversation ``sid``: its items come before the new input (rendered here, FORMAT.md 7.5)."""
        prior = conversation_messages(read_state(self.engine, sid).items)
        instructions = self.record.instructions
        self.chain = [*prior, *self.chain]
        self.spec.messages = [*([{"role": "system", "content": instructions}] if instructions else []), *self.chain]
        self.spec.session, self.spec.prompt_ids = sid, None
        self.record.conversation = sid

    def run(self, sink: TurnSink) -> TurnOutcome:
        engine, spec = self.engine, self.spec
        if self.conversation is not None:
            self.on_conversation(self.conversation)
        admitted = engine.runner.admit(spec)  # the prompt checked once, for placing and the turn
        extra = self.place(self.previous, admitted.ids) if self.previous is not None else None
        try:
            out = engine.run_turn(spec, sink, admitted)
            assert spec.session is not None
            session, _ = engine.open_session(spec.session, create=False)
            history = session.history()
            record = self.record
            finish_record(record, out)
            record.session, record.tokens, record.digest = spec.session, len(history), tokens_digest(history)
            record.messages = [*self.chain, {"role": "assistant", "content": out.text}]
            if self.conversation is not None:  # its items and the record: one write, with its session
                save_turn(engine, self.conversation, record, self.store)
            else:
                keep_with_session(engine.store.session_dir(spec.session), record)  # travels with its bundles
            return out
        except BaseException:
            if extra is not None and engine.store.exists(extra):  # a refused branch leaves no session
                engine.delete(extra)
            raise
        finally:
            engine.release(extra)

    def publish(self, out: TurnOutcome) -> TurnOutcome:
        """Make the finished turn's record visible (here, and to the fleet), run once its session is
        free (``Engine.submit``'s ``then``): a client that sees the record can continue it at once."""
        record = self.record
        if self.store:
            self.records.write(record)
        if self.fleet is not None and self.store:  # any host of the fleet can continue the chain
            try:
                self.fleet.put(record)
            except ColiError as exc:
                log.error("responses.fleet_put_failed", id=record.id, error=str(exc))
        return out

    def previous_session(self, prev: ResponseRecord) -> Session | None:
        """``prev``'s session, opened: here, or pulled from the fleet (``serve --remote``); None when
        it is gone."""
        if not self.engine.store.exists(prev.session) and self.engine.home is None:
            return None
        try:
            session, _ = self.engine.open_session(prev.session, create=False)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return session

    def place(self, prev: ResponseRecord, prompt: list[int]) -> str | None:
        """Point the turn at the session to continue ``prev`` on (a fork where its history and
        ``prompt``, the turn's checked ids, part); the new session's id, claimed (None when in place)."""
        engine, spec = self.engine, self.spec
        new = chain_session_id()
        session = self.previous_session(prev)
        if session is not None:
            history = session.history()
            in_place = prev.conversation is None  # a conversation's session holds its items' tokens: fork
            if in_place and len(history) == prev.tokens and tokens_digest(history) == prev.digest:
                return None
            shared = common_prefix(history, prompt)
            if shared > 0:
                engine.claim(new)
                try:
                    engine.fork(prev.session, new, min(shared, session.committed))
                except BaseException:
                    engine.release(new)
                    raise
                spec.session = new
                return new
        engine.claim(new)
        spec.session = new
        return new


__all__ = ["StoredResponseTurn"]
