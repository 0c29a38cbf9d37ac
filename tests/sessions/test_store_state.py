"""A hypothesis state machine over the store against a plain in-memory model of it.

Operations: create, generate (continue / extend / diverge), append without commit, commit,
suspend, resume, fork, truncate, crash (drop without committing), reopen (new store object),
delete. The model holds, per session, the committed record tokens and the pending token of the
last commit, plus what has been appended since. Invariant after every step: what the store
reports from disk (no lock taken) is exactly the model's last commit, and a resident session's
cache begins with it. No committed token is ever lost or changed.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kernels.model import load_model
from kernels.model.sampling import Sampler
from sessionstore.sessions import SessionOptions
from sessionstore.sessions.session import Session
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turn_loop import common_prefix

IDS = st.sampled_from(["a", "b", "c"])
TOKENS = st.lists(st.integers(0, 259), min_size=1, max_size=5)
MODEL = load_model("tiny")


@dataclass
class Entry:
    committed: list[int] = field(default_factory=list)  # records as of the last commit
    committed_pending: list[int] = field(default_factory=list)
    records: list[int] = field(default_factory=list)  # appended records (committed or not)
    pending: list[int] = field(default_factory=list)
    session: Session | None = None

    def acknowledge(self) -> None:
        self.committed, self.committed_pending = list(self.records), list(self.pending)


class StoreMachine(RuleBasedStateMachine):
    @initialize(kv=st.sampled_from(["f32", "fp8"]), sampled=st.booleans(), prompt=TOKENS,
                max_new=st.integers(0, 4))
    def setup(self, kv: str, sampled: bool, prompt: list[int], max_new: int) -> None:
        self.root = tempfile.mkdtemp(prefix="h6-state-")
        self.store = SessionStore(self.root)
        self.model: dict[str, Entry] = {}
        self.create("a", kv, sampled, prompt, max_new)

    def teardown(self) -> None:
        for entry in self.model.values():
            if entry.session is not None:
                entry.session.abandon()
        shutil.rmtree(self.root, ignore_errors=True)

    def _session(self, sid: str) -> Session:
        entry = self.model[sid]
        if entry.session is None or entry.session.state == "closed":
            entry.session = self.store.open(sid, options=SessionOptions(commit_every=3))
        return entry.session

    # ---- rules ----------------------------------------------------------------------------
    @rule(sid=IDS, kv=st.sampled_from(["f32", "fp8"]), sampled=st.booleans(), prompt=TOKENS,
          max_new=st.integers(0, 4))
    def create(self, sid: str, kv: str, sampled: bool, prompt: list[int], max_new: int) -> None:
        if sid in self.model:
            return
        sampler = Sampler(0.9, 20, 0.9, 5) if sampled else Sampler()
        s = self.store.create(sid, "tiny", kv_dtype=kv, sampler=sampler, options=SessionOptions(commit_every=3))
        entry = self.model[sid] = Entry(session=s)
        out = s.generate(prompt, max_new).tokens
        entry.records = prompt + out[:-1]
        entry.pending = out[-1:]
        entry.acknowledge()

    @precondition(lambda self: self.model)
    @rule(data=st.data(), kind=st.sampled_from(["continue", "extend", "diverge"]), extra=TOKENS,
          max_new=st.integers(0, 4))
    def generate(self, data, kind: str, extra: list[int], max_new: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        entry = self.model[sid]
        history = entry.records + entry.pending
        if kind == "continue":
            if not entry.pending and not entry.records:
                return
            prompt = None
        elif kind == "extend":
            prompt = history + extra
        else:
            prompt = history[: data.draw(st.integers(0, len(history)))] + extra
        s = self._session(sid)
        out = s.generate(prompt, max_new).tokens
        if prompt is None:
            entry.records = entry.records + entry.pending + out[:-1]  # the pending token is fed first
        else:
            k = common_prefix(entry.records, prompt)
            entry.records = prompt + out[:-1]
            assert entry.records[:k] == prompt[:k]
        entry.pending = out[-1:]
        entry.acknowledge()  # end of turn: always committed

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=TOKENS)
    def append_uncommitted(self, data, tokens: list[int]) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        entry = self.model[sid]
        s = self._session(sid)
        s.options = replace(s.options, commit_every=None)
        s.append_tokens(tokens, commit=False)
        s.options = replace(s.options, commit_every=3)
        entry.records = entry.records + tokens
        entry.pending = []

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def commit(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self._session(sid).commit()
        self.model[sid].acknowledge()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def suspend(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        entry = self.model[sid]
        if entry.session is not None:
            entry.session.suspend()
            entry.acknowledge()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def crash(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        entry = self.model[sid]
        if entry.session is not None:
            entry.session.abandon()
            entry.session = None
        entry.records, entry.pending = list(entry.committed), list(entry.committed_pending)

    @rule()
    def reopen_store(self) -> None:
        """A new process: drop every session object as a crash would, then a fresh store."""
        for entry in self.model.values():
            if entry.session is not None:
                entry.session.abandon()
                entry.session = None
            entry.records, entry.pending = list(entry.committed), list(entry.committed_pending)
        self.store = SessionStore(self.root)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def resume(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        s = self._session(sid)
        s.ensure_resident()
        assert s.resume_report["verified"] in ("bit-identical", "recomputed (no digest to compare)",
                                               "empty")

    @precondition(lambda self: self.model)
    @rule(data=st.data(), new=IDS)
    def fork(self, data, new: str) -> None:
        src = data.draw(st.sampled_from(sorted(self.model)))
        if new in self.model:
            return
        entry = self.model[src]
        at = data.draw(st.integers(0, len(entry.committed)))
        self.store.fork(src, new, at=at)
        pending = entry.committed_pending if at == len(entry.committed) else [entry.committed[at]]
        fork = self.model[new] = Entry(committed=entry.committed[:at], committed_pending=list(pending))
        fork.records, fork.pending = list(fork.committed), list(fork.committed_pending)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        entry = self.model[sid]
        n = data.draw(st.integers(0, len(entry.records) + 2))
        self._session(sid).truncate(n)
        entry.records, entry.pending = entry.records[:n], []
        entry.acknowledge()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model)))
        entry = self.model.pop(sid)
        if entry.session is not None:
            entry.session.close()
        self.store.delete(sid)

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def disk_holds_exactly_the_last_commit(self) -> None:
        if not hasattr(self, "store"):
            return
        assert sorted(i.id for i in self.store.directory.list()) == sorted(self.model)
        for sid, entry in self.model.items():
            assert self.store.history(sid) == entry.committed + entry.committed_pending, sid
            s = entry.session
            if s is not None and s.state == "resident":
                assert [int(t) for t in s.cache.tokens] == entry.records, sid


StoreMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_store_state_machine = StoreMachine.TestCase
