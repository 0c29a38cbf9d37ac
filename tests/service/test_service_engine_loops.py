"""The engine thread runs each turn's decode loop between its batched steps: the tokens are the
ones the loop gives run inline, the turn's thread is woken once per loop, not once per token, and
the mid-turn commits that loops ask for in one pass start together and run beside the next step (their
waits overlap each other and the step), a failed one ending only its own turn, its step undone."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sessionstore.service.batcher import MAX_PREFILL_TOKENS, StepBatcher
from sessionstore.service.group_commit import GroupCommit
from sessionstore.service.scheduler import DecoderBaton
from sessionstore.sessions.turn_loop import decode_loop, drive_inline

VOCAB = 11


class _Cache:
    """A stand-in cache: an id and a length (each step adds one), truncated as a session's is."""

    def __init__(self, cache_id: int) -> None:
        self.id, self.length = cache_id, 0

    def truncate(self, n: int) -> int:
        self.length = max(0, min(n, self.length))
        return self.length


class _ChainModel:
    """A stand-in decoder whose next-token logits depend on the token fed and on the cache: the
    argmax after feeding t to cache c is (3 t + c.id + c.length) % VOCAB. Records each step's size."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def check_tokens(self, tokens: np.ndarray) -> np.ndarray:
        return np.asarray(tokens, np.int32)

    def check_room(self, cache: object, n: int) -> None:
        return None

    def _row(self, token: int, cache: _Cache) -> np.ndarray:
        cache.length += 1
        row = np.zeros(VOCAB, np.float32)  # [V] f32
        row[(3 * token + cache.id + cache.length) % VOCAB] = 1.0
        return row

    def forward(self, tokens: np.ndarray, cache: _Cache) -> np.ndarray:
        return np.stack([self._row(int(t), cache) for t in tokens])  # [S, V] f32

    def step(self, caches: list[_Cache], tokens: np.ndarray, counts: list[int]) -> np.ndarray:
        """Each cache's run of ``tokens`` fed in order; the logits of each one's last: [B, V] f32."""
        self.batches.append(len(caches))
        rows, start = [], 0
        for cache, count in zip(caches, counts, strict=True):
            rows.append([self._row(int(t), cache) for t in tokens[start : start + count]][-1])
            start += count
        return np.stack(rows)  # [B, V] f32


class _CountingBaton(DecoderBaton):
    def __init__(self) -> None:
        super().__init__()
        self.admits = 0

    def admit(self, ticket: Any) -> None:
        self.admits += 1
        super().admit(ticket)


def _greedy(logits: np.ndarray, position: int) -> int:
    return int(np.argmax(logits))


def _start(i: int) -> np.ndarray:
    row = np.zeros(VOCAB, np.float32)  # [V] f32: the logits a prompt left
    row[i % VOCAB] = 1.0
    return row


OnStep = Callable[[StepBatcher, int, int, int, np.ndarray], None]  # (batcher, turn, token, position, logits)


def _run_turns(n: int, max_new: int, on_step: OnStep | None = None,
               model: _ChainModel | None = None) -> tuple[dict[int, Any], _ChainModel, _CountingBaton, list[_Cache]]:
    """``n`` turns in threads, each driving a decode loop through one batcher; their outcomes
    (the loop's end, or the error it raised), and their caches."""
    model, baton = model or _ChainModel(), _CountingBaton()
    batcher = StepBatcher(model, baton, gather_s=5.0)  # each step waits for every turn in flight
    outcomes: dict[int, Any] = {}
    caches = [_Cache(i) for i in range(n)]
    for _ in range(n):
        batcher.turn_started()

    def turn(i: int) -> None:
        cache = caches[i]
        step = None if on_step is None else (lambda tok, pos, lg: on_step(batcher, i, tok, pos, lg))
        loop = decode_loop(cache, _start(i), max_new, _greedy, frozenset(), None, step)
        with baton.held():
            try:
                outcomes[i] = batcher.drive_decode(loop, cache)
            except Exception as exc:  # the test reads it
                outcomes[i] = exc
            assert baton.held_by_me()  # woken holding the baton
        batcher.turn_ended()

    threads = [threading.Thread(target=turn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    batcher.stop()
    return outcomes, model, baton, caches


def _inline(i: int, max_new: int) -> list[int]:
    cache = _Cache(i)
    tokens, _, _ = drive_inline(_ChainModel(), cache, decode_loop(cache, _start(i), max_new, _greedy,
                                                                     frozenset(), None, None))
    return tokens


def test_loops_run_on_the_engine_thread_give_the_inline_tokens_and_wake_each_turn_once() -> None:
    threads_seen: dict[int, set[str]] = {}

    def on_step(batcher: StepBatcher, i: int, token: int, position: int, logits: np.ndarray) -> None:
        if position > 0:  # the first sample is the turn's own, before its loop goes to the engine
            threads_seen.setdefault(i, set()).add(threading.current_thread().name)

    outcomes, model, baton, _ = _run_turns(3, 8, on_step)
    for i in range(3):
        tokens, _, eos = outcomes[i]
        assert tokens == _inline(i, 8) and not eos
    assert threads_seen == {i: {"coli-engine"} for i in range(3)}
    assert model.batches == [3] * 7  # 8 tokens: 7 fed, every step shared by the three
    assert baton.admits == 3  # one wake-up per turn, at its loop's end


def test_a_loop_that_raises_ends_only_its_own_turn() -> None:
    def on_step(batcher: StepBatcher, i: int, token: int, position: int, logits: np.ndarray) -> None:
        if i == 1 and position == 3:
            raise RuntimeError("client went away")

    outcomes, _, _, _ = _run_turns(2, 6, on_step)
    assert isinstance(outcomes[1], RuntimeError) and "went away" in str(outcomes[1])
    assert outcomes[0][0] == _inline(0, 6)


class _StepWatchingModel(_ChainModel):
    """Records, at each batched step, how many turns' commits are still running beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.batcher: StepBatcher | None = None
        self.beside: list[int] = []

    def step(self, caches: list[_Cache], tokens: np.ndarray, counts: list[int]) -> np.ndarray:
        assert self.batcher is not None
        self.beside.append(self.batcher.commits.in_flight())
        return super().step(caches, tokens, counts)


def test_commits_of_one_pass_run_together_beside_the_next_step_and_a_failure_ends_only_its_turn() -> None:
    ran: list[tuple[int, int]] = []
    model = _StepWatchingModel()

    def slow_commit(i: int, position: int) -> Callable[[], None]:
        def commit() -> None:
            time.sleep(0.3)
            if i == 2:
                raise OSError("disk full")
            ran.append((i, position))
        return commit

    def on_step(batcher: StepBatcher, i: int, token: int, position: int, logits: np.ndarray) -> None:
        model.batcher = batcher
        if position == 2:
            batcher.run_commit(slow_commit(i, position))

    t0 = time.perf_counter()
    outcomes, _, _, caches = _run_turns(3, 5, on_step, model)
    took = time.perf_counter() - t0
    assert isinstance(outcomes[2], OSError) and "disk full" in str(outcomes[2])
    assert outcomes[0][0] == _inline(0, 5) and outcomes[1][0] == _inline(1, 5)
    assert sorted(ran) == [(0, 2), (1, 2)]
    assert took < 0.75, f"three 0.3 s commits of one pass took {took:.2f} s: they did not overlap"
    # positions 0..4 sampled, 4 fed; the commits asked for at position 2 ran beside the step of the
    # token sampled there (the third step), never beside another
    assert model.beside == [0, 0, 3, 0, 0][: len(model.beside)] and model.beside[2] == 3
    assert caches[2].length == 2  # the failed turn's step that ran beside its commit is undone
    assert caches[0].length == caches[1].length == 4


def test_a_loop_that_ends_in_the_pass_of_its_commit_wakes_its_turn_after_the_commit() -> None:
    done: list[str] = []

    def on_step(batcher: StepBatcher, i: int, token: int, position: int, logits: np.ndarray) -> None:
        if position == 3:  # the last token (max_new 4): the loop ends in this pass
            batcher.run_commit(lambda: (time.sleep(0.2), done.append(f"commit {i}")))

    model, baton = _ChainModel(), DecoderBaton()
    batcher = StepBatcher(model, baton, gather_s=5.0)
    batcher.turn_started()
    cache = _Cache(0)
    loop = decode_loop(cache, _start(0), 4, _greedy, frozenset(), None,
                       lambda tok, pos, lg: on_step(batcher, 0, tok, pos, lg))
    with baton.held():
        tokens, _, _ = batcher.drive_decode(loop, cache)
        done.append("woken")
    batcher.turn_ended()
    batcher.stop()
    assert tokens == _inline(0, 4)
    assert done == ["commit 0", "woken"]


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


def test_a_turn_commits_its_end_without_the_baton_and_the_others_step_on() -> None:
    """Turn 0's loop ends early and it commits on its own thread (slowly); turn 1 keeps stepping
    meanwhile: the baton is not held during that commit, nor is turn 0 waited for by the steps
    (with a 5 s gather, one step waiting for it would take 5 s)."""
    model, baton = _ChainModel(), DecoderBaton()
    batcher = StepBatcher(model, baton, gather_s=5.0)
    ended: dict[str, float] = {}
    outcomes: dict[int, Any] = {}

    def slow_commit() -> None:
        time.sleep(1.0)
        ended["commit"] = time.perf_counter()

    def turn(i: int, max_new: int) -> None:
        cache = _Cache(i)
        loop = decode_loop(cache, _start(i), max_new, _greedy, frozenset(), None, None)
        with baton.held():
            outcomes[i] = batcher.drive_decode(loop, cache)
            if i == 0:
                batcher.run_commit(slow_commit)
                assert baton.held_by_me()  # the turn holds the baton again after its commit
            ended[f"turn {i}"] = time.perf_counter()
        batcher.turn_ended()

    for _ in range(2):
        batcher.turn_started()
    threads = [threading.Thread(target=turn, args=(0, 3)), threading.Thread(target=turn, args=(1, 12))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    batcher.stop()
    assert outcomes[0][0] == _inline(0, 3) and outcomes[1][0] == _inline(1, 12)
    assert ended["turn 1"] < ended["commit"], "turn 1 waited for turn 0's commit"
    assert time.perf_counter() - t0 < 4.0


class _CountsModel(_ChainModel):
    """Records every step's members: (cache id, tokens it stepped)."""

    def __init__(self) -> None:
        super().__init__()
        self.members: list[list[tuple[int, int]]] = []

    def step(self, caches: list[_Cache], tokens: np.ndarray, counts: list[int]) -> np.ndarray:
        self.members.append([(c.id, n) for c, n in zip(caches, counts, strict=True)])
        time.sleep(0.002)  # a step takes time, as a real one does: the prompt's thread is in long before the loops end
        return super().step(caches, tokens, counts)


def _prompt_alone(cache_id: int, n: int) -> np.ndarray:
    cache = _Cache(cache_id)
    return _ChainModel().forward(np.arange(n, dtype=np.int32), cache)[-1:]  # [1, V]: the last position's logits


def test_a_prompt_is_admitted_in_chunks_beside_running_loops_and_alone_in_one_step() -> None:
    prompt_len = 100
    got: dict[str, np.ndarray] = {}
    asked: list[threading.Thread] = []

    def on_step(batcher: StepBatcher, i: int, token: int, position: int, logits: np.ndarray) -> None:
        if i == 0 and position == 2:  # both loops are running: a prompt arrives
            def ask() -> None:
                got["prompt"] = batcher.forward(np.arange(prompt_len, dtype=np.int32), _Cache(9))
            asked.append(threading.Thread(target=ask))
            asked[0].start()

    model = _CountsModel()
    outcomes, _, _, _ = _run_turns(2, 200, on_step, model)  # long loops: still running once the prompt is in
    asked[0].join(10)
    for i in range(2):
        assert outcomes[i][0] == _inline(i, 200)  # the loops' tokens are unchanged by the prompt beside them
    assert np.array_equal(got["prompt"], _prompt_alone(9, prompt_len))
    chunks = [dict(step)[9] for step in model.members if 9 in dict(step)]  # the prompt's, step by step
    beside = [dict(step)[9] for step in model.members if 9 in dict(step) and {0, 1} & set(dict(step))]
    assert sum(chunks) == prompt_len and beside and max(beside) <= MAX_PREFILL_TOKENS
    assert sum(beside) == prompt_len  # the loops outlast it: every chunk shared a step with them
    alone = _CountsModel()
    batcher = StepBatcher(alone, DecoderBaton())
    try:
        assert np.array_equal(batcher.forward(np.arange(prompt_len, dtype=np.int32), _Cache(9)),
                              _prompt_alone(9, prompt_len))
    finally:
        batcher.stop()
    assert alone.members == [[(9, prompt_len)]]  # no one decoding: the whole prompt in one step
