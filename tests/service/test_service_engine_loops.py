"""The engine loop (:mod:`sessionstore.service.steps.loop`): every request's work is a job, a
greenlet on the loop's one thread, never a thread of its own. The loop runs each turn's decode loop
between its batched steps itself (the tokens are the ones the decode loop gives run inline, and the
job runs on once per decode loop, not once per token); the mid-turn commits that decode loops ask
for in one pass start together and run beside the next step (their waits overlap each other and the
step), a failed one ending only its own turn, its step undone; a job's own commit runs on an I/O
thread while the loop steps the others on; prompts are admitted in chunks beside running streams."""
from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import greenlet
import numpy as np
import pytest

from kernels.errors import FormatError
from sessionstore.service.steps.group_commit import GroupCommit
from sessionstore.service.steps.loop import EngineLoop
from sessionstore.service.steps.prefill_pacer import GROWTH, MAX_PREFILL_TOKENS, PROBE_TOKENS, PrefillPacer
from sessionstore.sessions.output import TurnEnd
from sessionstore.sessions.turn_loop import RunningTurn, drive_inline
from tests.support.chain_decoder import ChainCache, ChainDecoder, greedy, start_logits

VOCAB = 11
GATHER_S = 0.3  # the tests' jobs are all submitted well within it: they start together


class _ChainModel(ChainDecoder):
    """The stand-in decoder: the argmax after feeding t to cache c is (3 t + c.id + c.length) % VOCAB.
    Records each step's size."""

    def __init__(self) -> None:
        super().__init__(3, VOCAB)
        self.batches: list[int] = []

    def on_step(self, caches: Sequence[ChainCache], counts: Sequence[int]) -> None:
        self.batches.append(len(caches))


def _start(i: int) -> np.ndarray:
    return start_logits(i, VOCAB)  # [V] f32: the logits a prompt left


OnStep = Callable[[EngineLoop, int, int, int, np.ndarray], None]  # (loop, turn, token, position, logits)


class _Switches:
    """Counts, on the loop's thread, how often the loop switched back into each job after its
    start (greenlet's trace hook, installed by the first job to start)."""

    def __init__(self) -> None:
        self.jobs: dict[Any, int] = {}  # a job's greenlet -> its turn
        self.ran_on: dict[int, int] = {}

    def install(self) -> None:
        if greenlet.gettrace() is None:
            greenlet.settrace(self._trace)

    def _trace(self, event: str, args: Any) -> None:
        if event in ("switch", "throw") and args[1] in self.jobs:
            turn = self.jobs[args[1]]
            self.ran_on[turn] = self.ran_on.get(turn, 0) + 1


def _run_turns(n: int, max_new: int, on_step: OnStep | None = None, model: _ChainModel | None = None,
               whole: int = 0) -> tuple[dict[int, Any], _ChainModel, list[ChainCache], _Switches]:
    """``n`` turns as jobs on one loop, each driving a decode loop; their outcomes (the decode
    loop's end, or the error it raised), their caches, and the switches into the jobs. ``whole``:
    the loop's ``whole_prompt_tokens`` (0: every prompt beside the loops paced, as these tests of
    the pacer want)."""
    model = model or _ChainModel()
    loop = EngineLoop(model, gather_s=GATHER_S, whole_prompt_tokens=whole)
    outcomes: dict[int, Any] = {}
    caches = [ChainCache(i) for i in range(n)]
    switches = _Switches()

    def turn(i: int) -> None:
        switches.jobs[greenlet.getcurrent()] = i
        switches.install()
        cache = caches[i]
        step = None if on_step is None else (lambda tok, pos, lg: on_step(loop, i, tok, pos, lg))
        decode = RunningTurn(cache, _start(i), max_new, greedy, frozenset(), None, step)
        try:
            outcomes[i] = loop.drive_decode(decode, cache)
        except Exception as exc:  # the test reads it
            outcomes[i] = exc

    futures = [loop.submit(lambda i=i: turn(i)) for i in range(n)]
    for fut in futures:
        fut.result(20)
    loop.submit(lambda: greenlet.settrace(None)).result(5)
    loop.stop()
    return outcomes, model, caches, switches


def _inline(i: int, max_new: int) -> list[int]:
    cache = ChainCache(i)
    return drive_inline(_ChainModel(), cache, RunningTurn(cache, _start(i), max_new, greedy, frozenset(), None,
                                                          None)).tokens


def test_loops_run_on_the_loop_itself_give_the_inline_tokens_and_run_each_job_on_once() -> None:
    seen: dict[int, set[tuple[str, bool]]] = {}

    def on_step(loop: EngineLoop, i: int, token: int, position: int, logits: np.ndarray) -> None:
        if position > 0:  # the first sample is the job's own, before its decode loop goes to the loop
            on_hub = greenlet.getcurrent().parent is None  # the loop's own greenlet, not the job's
            seen.setdefault(i, set()).add((threading.current_thread().name, on_hub))

    outcomes, model, _, switches = _run_turns(3, 8, on_step)
    for i in range(3):
        assert outcomes[i].tokens == _inline(i, 8) and outcomes[i].end is TurnEnd.LENGTH
    assert seen == {i: {("coli-engine", True)} for i in range(3)}
    assert model.batches == [3] * 7  # 8 tokens: 7 fed, every step shared by the three
    assert switches.ran_on == {0: 1, 1: 1, 2: 1}  # each job ran on once, at its decode loop's end


def test_jobs_run_on_the_loop_thread_not_a_thread_each() -> None:
    model = _ChainModel()
    loop = EngineLoop(model, gather_s=GATHER_S)
    where: list[str] = []
    before = threading.active_count()

    def job(i: int) -> int:
        where.append(threading.current_thread().name)
        logits = loop.forward(np.asarray([i], np.int32), ChainCache(i))
        return int(np.argmax(logits))

    try:
        futures = [loop.submit(lambda i=i: job(i)) for i in range(16)]
        outcomes = [fut.result(10) for fut in futures]
        during = threading.active_count()
    finally:
        loop.stop()
    assert where == ["coli-engine"] * 16 and during == before  # no thread was started for a job
    assert outcomes == [int(np.argmax(_ChainModel().forward(np.asarray([i]), ChainCache(i))[-1])) for i in range(16)]
    assert model.batches == [16]  # the 16 jobs' forwards shared one step
    with pytest.raises(RuntimeError, match="stopped"):
        loop.submit(lambda: None)


def test_a_loop_that_raises_ends_only_its_own_turn() -> None:
    def on_step(loop: EngineLoop, i: int, token: int, position: int, logits: np.ndarray) -> None:
        if i == 1 and position == 3:
            raise RuntimeError("client went away")

    outcomes, _, _, _ = _run_turns(2, 6, on_step)
    assert isinstance(outcomes[1], RuntimeError) and "went away" in str(outcomes[1])
    assert outcomes[0].tokens == _inline(0, 6)


def test_a_job_that_raises_hands_its_error_to_its_caller_and_the_loop_serves_on() -> None:
    loop = EngineLoop(_ChainModel(), gather_s=0.0)
    try:
        def bad() -> None:
            loop.forward(np.asarray([1], np.int32), ChainCache(0))
            raise ValueError("bad request")

        with pytest.raises(ValueError, match="bad request"):
            loop.submit(bad).result(5)
        assert loop.submit(lambda: 7).result(5) == 7 and loop.in_flight() == 0
    finally:
        loop.stop()


class _StepWatchingModel(_ChainModel):
    """Records, at each batched step, how many turns' commits are still running beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: EngineLoop | None = None
        self.beside: list[int] = []

    def step(self, caches: list[ChainCache], tokens: np.ndarray, counts: list[int]) -> np.ndarray:
        assert self.loop is not None
        self.beside.append(self.loop.commits.in_flight())
        return super().step(caches, tokens, counts)


def test_commits_of_one_pass_run_together_beside_the_next_step_and_a_failure_ends_only_its_turn() -> None:
    ran: list[tuple[int, int]] = []
    spans: dict[int, tuple[float, float]] = {}  # each commit's start and end
    model = _StepWatchingModel()

    def slow_commit(i: int, position: int) -> Callable[[], None]:
        def commit() -> None:
            start = time.perf_counter()
            time.sleep(0.3)
            spans[i] = (start, time.perf_counter())
            if i == 2:
                raise OSError("disk full")
            ran.append((i, position))
        return commit

    def on_step(loop: EngineLoop, i: int, token: int, position: int, logits: np.ndarray) -> None:
        model.loop = loop
        if position == 2:
            loop.run_commit(slow_commit(i, position))

    outcomes, _, caches, _ = _run_turns(3, 5, on_step, model)
    assert isinstance(outcomes[2], OSError) and "disk full" in str(outcomes[2])
    assert outcomes[0].tokens == _inline(0, 5) and outcomes[1].tokens == _inline(1, 5)
    assert sorted(ran) == [(0, 2), (1, 2)]
    # the three 0.3 s commits of one pass ran at once: each started before any of them ended (a wall
    # time bound would depend on the machine's load; the overlap does not)
    assert max(start for start, _ in spans.values()) < min(end for _, end in spans.values()), spans
    # positions 0..4 sampled, 4 fed; the commits asked for at position 2 ran beside the step of the
    # token sampled there (the third step), never beside another
    assert model.beside == [0, 0, 3, 0, 0][: len(model.beside)] and model.beside[2] == 3
    assert caches[2].length == 2  # the failed turn's step that ran beside its commit is undone
    assert caches[0].length == caches[1].length == 4


def test_a_loop_that_ends_in_the_pass_of_its_commit_runs_its_job_on_after_the_commit() -> None:
    done: list[str] = []
    loop = EngineLoop(_ChainModel(), gather_s=0.0)

    def job() -> list[int]:
        cache = ChainCache(0)
        decode = RunningTurn(cache, _start(0), 4, greedy, frozenset(), None,
                             lambda tok, pos, lg: pos == 3 and loop.run_commit(  # the last token: ends in this pass
                                 lambda: (time.sleep(0.2), done.append("commit 0"))))
        tokens = loop.drive_decode(decode, cache).tokens
        done.append("ran on")
        return tokens

    try:
        tokens = loop.submit(job).result(10)
    finally:
        loop.stop()
    assert tokens == _inline(0, 4)
    assert done == ["commit 0", "ran on"]


def test_group_commit_outside_a_pass_does_not_put_off() -> None:
    group = GroupCommit(4)
    assert not group.put_off(lambda: None)  # no loop being run on: the caller commits now
    seen: list[str] = []
    with group.collecting("a"):
        assert group.put_off(lambda: seen.append("a"))
        other: list[bool] = []
        t = threading.Thread(target=lambda: other.append(group.put_off(lambda: None)))
        t.start()
        t.join()
        assert other == [False]  # another thread's commit is not this pass's
    assert seen == []
    group.start_all()
    assert group.wait("a") is None and seen == ["a"] and group.in_flight() == 0
    group.close()


def test_a_job_commits_on_an_io_thread_and_the_others_step_on() -> None:
    """Turn 0's decode loop ends early and its job commits (slowly): the commit runs on an I/O
    thread while turn 1 keeps stepping; turn 0's job runs on after it."""
    loop = EngineLoop(_ChainModel(), gather_s=GATHER_S)
    ended: dict[str, float] = {}
    committed_on: list[str] = []

    def slow_commit() -> None:
        committed_on.append(threading.current_thread().name)
        time.sleep(1.0)
        ended["commit"] = time.perf_counter()

    def turn(i: int, max_new: int) -> list[int]:
        cache = ChainCache(i)
        tokens = loop.drive_decode(RunningTurn(cache, _start(i), max_new, greedy, frozenset(), None, None),
                                   cache).tokens
        if i == 0:
            loop.run_commit(slow_commit)
            assert threading.current_thread().name == "coli-engine"  # back on the loop, after the commit
        ended[f"turn {i}"] = time.perf_counter()
        return tokens

    t0 = time.perf_counter()
    try:
        futures = [loop.submit(lambda: turn(0, 3)), loop.submit(lambda: turn(1, 12))]
        outcomes = [fut.result(30) for fut in futures]
    finally:
        loop.stop()
    assert outcomes == [_inline(0, 3), _inline(1, 12)]
    assert committed_on and committed_on[0].startswith("coli-engine-io")
    assert ended["turn 1"] < ended["commit"] < ended["turn 0"], "turn 1 waited for turn 0's commit"
    assert time.perf_counter() - t0 < 4.0


class _CountsModel(_ChainModel):
    """Records every step's members: (cache id, tokens it stepped)."""

    def __init__(self) -> None:
        super().__init__()
        self.members: list[list[tuple[int, int]]] = []

    def on_step(self, caches: Sequence[ChainCache], counts: Sequence[int]) -> None:
        super().on_step(caches, counts)
        self.members.append([(c.id, n) for c, n in zip(caches, counts, strict=True)])


def _prompt_alone(cache_id: int, n: int) -> np.ndarray:
    cache = ChainCache(cache_id)
    return _ChainModel().forward(np.arange(n, dtype=np.int32), cache)[-1:]  # [1, V]: the last position's logits


def test_a_prompt_is_admitted_in_chunks_beside_running_loops_and_alone_in_one_step() -> None:
    prompt_len = 100
    asked: list[Any] = []

    def on_step(loop: EngineLoop, i: int, token: int, position: int, logits: np.ndarray) -> None:
        if i == 0 and position == 2:  # both decode loops are running: a prompt arrives
            asked.append(loop.submit(lambda: loop.forward(np.arange(prompt_len, dtype=np.int32), ChainCache(9))))

    model = _CountsModel()
    outcomes, _, _, _ = _run_turns(2, 200, on_step, model)  # long loops: still running once the prompt is in
    for i in range(2):
        assert outcomes[i].tokens == _inline(i, 200)  # the loops' tokens are unchanged by the prompt beside them
    assert np.array_equal(asked[0].result(10), _prompt_alone(9, prompt_len))
    chunks = [dict(step)[9] for step in model.members if 9 in dict(step)]  # the prompt's, step by step
    beside = [dict(step)[9] for step in model.members if 9 in dict(step) and {0, 1} & set(dict(step))]
    assert sum(chunks) == prompt_len and beside and max(beside) <= MAX_PREFILL_TOKENS
    assert sum(beside) == prompt_len  # the loops outlast it: every chunk shared a step with them
    alone = _CountsModel()
    loop = EngineLoop(alone, gather_s=0.0)
    try:
        got = loop.submit(lambda: loop.forward(np.arange(prompt_len, dtype=np.int32), ChainCache(9))).result(10)
    finally:
        loop.stop()
    assert np.array_equal(got, _prompt_alone(9, prompt_len))
    assert alone.members == [[(9, prompt_len)]]  # no one decoding: the whole prompt in one step


class _CountingModel:
    """A stand-in decoder: cache c's logits are [c.id] * V; records each step's batch size and
    refuses token ids below 0."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def check_tokens(self, tokens: np.ndarray) -> np.ndarray:
        if np.any(np.asarray(tokens) < 0):
            raise FormatError("token id -1 is outside the vocabulary")
        return np.asarray(tokens, np.int32)

    def check_room(self, cache: object, n: int) -> None:
        return None

    def forward(self, tokens: np.ndarray, cache: SimpleNamespace) -> np.ndarray:
        return np.full((len(tokens), 4), float(cache.id), np.float32)

    def step(self, caches: list[SimpleNamespace], tokens: np.ndarray, counts: list[int]) -> np.ndarray:
        self.batches.append(len(caches))
        return np.array([[float(c.id)] * 4 for c in caches], np.float32)


def test_jobs_share_one_step_and_each_gets_its_own_row_or_its_own_error() -> None:
    model = _CountingModel()
    loop = EngineLoop(model, gather_s=GATHER_S)
    try:
        futures = [loop.submit(lambda i=i: float(loop.forward(np.array([i], np.int32), SimpleNamespace(id=i))[0, 0]))
                   for i in range(4)]
        bad = loop.submit(lambda: loop.forward(np.array([-1], np.int32), SimpleNamespace(id=9)))
        assert [fut.result(10) for fut in futures] == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(FormatError, match="outside the vocabulary"):
            bad.result(10)
    finally:
        loop.stop()
    assert model.batches == [4]  # the bad one was refused before the step, alone


def test_a_caller_outside_the_jobs_gets_its_logits_or_its_own_error() -> None:
    model = _CountingModel()
    loop = EngineLoop(model, gather_s=0.0)
    try:
        assert loop.forward(np.array([5], np.int32), SimpleNamespace(id=7))[0, 0] == 7.0
        assert loop.forward(np.array([1, 2], np.int32), SimpleNamespace(id=3)).shape == (1, 4)  # a prefill: its
        # last position's logits
        with pytest.raises(FormatError, match="outside the vocabulary"):
            loop.forward(np.array([-1], np.int32), SimpleNamespace(id=1))
        assert loop.forward(np.array([5], np.int32), SimpleNamespace(id=2))[0, 0] == 2.0  # still serving
    finally:
        loop.stop()


def test_the_prefill_pacer_sizes_chunks_to_keep_a_step_within_its_ratio_of_a_decode_step() -> None:
    pacer = PrefillPacer(cap=32, ratio=3.0)
    pacer.observe(4, 0, 0.012)  # a decode-only step of 4 sessions: 3 ms a session
    pacer.observe(4, 32, 0.060)  # 4 sessions and 32 prompt tokens: (60 - 12) / 32 = 1.5 ms a token
    assert pacer.budget(4) == 16  # (3 - 1) x 12 ms of room / 1.5 ms
    assert pacer.budget(1) == 4
    pacer.observe(4, 16, 0.012 + 16 * 0.010)  # deep into a long prompt a token costs more
    assert 1 <= pacer.budget(4) < 16
    assert PrefillPacer(cap=8).budget(64) == PROBE_TOKENS  # unmeasured: a probe, whatever the batch
    assert PrefillPacer(cap=2).budget(64) == 2  # never past the cap
    slow = PrefillPacer(cap=32)
    slow.observe(1, 0, 0.001)
    slow.observe(1, 10, 10.0)  # a prompt token far dearer than a decode row: still one token a step
    assert slow.budget(1) == 1


def test_the_pacers_first_chunk_beside_decoding_sessions_is_a_probe_and_it_grows_only_from_measurement() -> None:
    pacer = PrefillPacer(cap=32, ratio=3.0)
    assert pacer.budget(4) == PROBE_TOKENS  # nothing measured: not the cap
    pacer.observe(4, 0, 0.012)  # decode-only steps measured
    pacer.observe(0, 2048, 0.5)  # an idle prefill (no one decoding, cheap per token): says nothing of a step
    assert pacer.budget(4) == PROBE_TOKENS  # beside decoding sessions, so still the probe
    sizes = []
    for _ in range(6):  # prompt tokens nearly free beside 4 rows: the budget grows GROWTH-fold a step
        sizes.append(pacer.budget(4))
        pacer.observe(4, sizes[-1], 0.012 + sizes[-1] * 1e-6)
    assert sizes == [min(32, PROBE_TOKENS * GROWTH**k) for k in range(6)]
    pacer.observe(4, 32, 0.012 + 32 * 0.003)  # dear ones (a long prompt's deep end): paced down
    assert pacer.budget(4) < 32


def test_a_long_prompts_first_chunk_beside_running_loops_is_the_probe_even_after_an_idle_prefill() -> None:
    """The loops' own prompts were prefilled with no one decoding (measured, but not beside decoding
    sessions); a long prompt arriving beside them starts with a probe, then grows at most GROWTH-fold."""
    prompt_len = 200
    asked: list[Any] = []

    def on_step(loop: EngineLoop, i: int, token: int, position: int, logits: np.ndarray) -> None:
        if i == 0 and position == 5:
            asked.append(loop.submit(lambda: loop.forward(np.arange(prompt_len, dtype=np.int32), ChainCache(9))))

    model = _CountsModel()
    loop = EngineLoop(model, gather_s=0.0, whole_prompt_tokens=0)

    def turn(i: int) -> Any:
        cache = ChainCache(i)
        step = lambda tok, pos, lg: on_step(loop, i, tok, pos, lg)  # noqa: E731
        return loop.drive_decode(RunningTurn(cache, _start(i), 300, greedy, frozenset(), None, step), cache)

    try:  # an idle prefill first: the pacer has measured prompt tokens, none beside decoding sessions
        loop.submit(lambda: loop.forward(np.arange(50, dtype=np.int32), ChainCache(8))).result(10)
        assert loop.batch.pacer.prompt_token_s is None
        for fut in [loop.submit(lambda i=i: turn(i)) for i in range(2)]:
            fut.result(20)
        assert np.array_equal(asked[0].result(10), _prompt_alone(9, prompt_len))
    finally:
        loop.stop()
    beside = [dict(step)[9] for step in model.members if 9 in dict(step) and {0, 1} & set(dict(step))]
    assert beside[0] <= PROBE_TOKENS, beside
    assert all(b <= max(PROBE_TOKENS, GROWTH * a) for a, b in zip(beside, beside[1:], strict=False)), beside


def test_chunks_beside_running_loops_follow_the_pacer() -> None:
    """With the loops' steps measured, the chunks beside them are the pacer's budget, not the cap."""
    prompt_len = 64
    asked: list[Any] = []

    class _Timed(_CountsModel):
        def step(self, caches: list[ChainCache], tokens: np.ndarray, counts: list[int]) -> np.ndarray:
            time.sleep(0.001 * len(caches) + 0.002 * (sum(counts) - len(caches)))  # a prompt token: 2x a row
            return super().step(caches, tokens, counts)

    def on_step(loop: EngineLoop, i: int, token: int, position: int, logits: np.ndarray) -> None:
        if i == 0 and position == 20:
            asked.append(loop.submit(lambda: loop.forward(np.arange(prompt_len, dtype=np.int32), ChainCache(9))))

    model = _Timed()
    _run_turns(2, 120, on_step, model)
    assert np.array_equal(asked[0].result(10), _prompt_alone(9, prompt_len))
    beside = [dict(step)[9] for step in model.members if 9 in dict(step) and {0, 1} & set(dict(step))]
    assert sum(beside) == prompt_len and min(beside) >= 1
    # paced once measured: (3 - 1) x 2 rows x 1 ms / ~2 ms = about 2 tokens a step, not the cap of
    # 32 (the median: a loaded machine's late wake-ups stretch a step's sleep now and then)
    assert statistics.median(beside[1:]) <= 8, beside


def test_a_pacer_with_ratio_zero_always_gives_the_cap() -> None:
    pacer = PrefillPacer(cap=4096, ratio=0)
    pacer.observe(4, 0, 0.012)
    pacer.observe(4, 32, 0.060)
    assert pacer.budget(4) == 4096  # off: the prompt in one piece beside the streams
