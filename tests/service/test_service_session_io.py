"""A session's file work runs off the engine loop's thread: creating a session (its kv file, sidecar,
manifest, their fsyncs, the catalogue's row) and resuming one (the lock, the mapping) run on the
loop's I/O threads while the loop steps the other sessions on, so a slow disk under a new session
does not stall the streams already running (nor the new session's own first token: its files are
made while its first turn runs); nor does handing a long prompt's rows to its kv file
(their writes and checksums); the new session's tokens stay exact."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kernels.model.sampling import Sampler
from sessionstore.kvfile.durability import Durability
from sessionstore.service.engine.engine import Engine
from sessionstore.service.wire.turn_spec import TurnSpec
from sessionstore.sessions import SessionOptions, SessionStore, reference_turns

SLOW_S = 0.4  # each slowed disk call under the new session: many decode steps' worth
RUNNING_TOKENS = 400  # the running stream's length: it is still running when the new session is made


class TimedSink:
    """Records when each piece of text arrives; ``started`` is set at the ``after``-th."""

    def __init__(self, after: int = 1, on_first: Any = None) -> None:
        self.times: list[float] = []
        self.after, self.started, self.on_first = after, threading.Event(), on_first

    def text(self, piece: str, logprobs: Any = None) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) == 1 and self.on_first is not None:
            self.on_first()
        if len(self.times) >= self.after:
            self.started.set()

    def cancelled(self) -> bool:
        return False


def _new_file(root: Path, fd: int, making: bool) -> bool:
    """Whether ``fd`` is one of the new session's files: under the store's ``tmp/`` while it is made,
    then (unless ``making``: only the files being made) its own directory."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return True
    made = () if making else (str(root / "sessions" / "new") + "/",)
    return path.startswith((str(root / "tmp") + "/", *made))


# (the disk call slowed, the new turn's prompt): a session's creation (its files' fsyncs), and a long
# prompt's rows handed to its kv file (their writes) once its prompt[:-1] has been stepped
CASES = {"create": ("fsync", [11, 12, 13, 14]), "prompt_rows": ("pwritev", [5 + (7 * i) % 290 for i in range(300)])}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names a descriptor's file through /proc")
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_slow_disk_under_a_new_session_does_not_stall_a_running_stream(
        case: str, tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = text_model
    step, prompt = CASES[case]
    slow = threading.Event()
    slow_on: list[str] = []
    real = getattr(Durability, step)

    def slowed(self: Durability, fd: int, *args: Any) -> Any:
        if slow.is_set() and _new_file(store.root, fd, making=case == "create"):  # a slow disk under the new session
            slow_on.append(threading.current_thread().name)
            time.sleep(SLOW_S)
        return real(self, fd, *args)

    monkeypatch.setattr(Durability, step, slowed)
    store = SessionStore(tmp_path)
    engine = Engine(store, str(text_model_dir), tokenizer=tok,
                    session_options=SessionOptions(commit_every=4096, lazy_logits=True))
    at_first: list[bool] = []  # whether the new session's directory was there at its first token

    def first() -> None:
        at_first.append(store.exists("new"))
        if case == "prompt_rows":
            slow.clear()  # its first token: the slow part is over (create's files are still being made)

    running, new = TimedSink(after=5), TimedSink(on_first=first)
    run_spec = TurnSpec("completion", "run", prompt=[7, 40, 41, 200, 9], max_tokens=RUNNING_TOKENS, ignore_eos=True,
                        sampling={"seed": 1})
    new_spec = TurnSpec("completion", "new", prompt=prompt, max_tokens=4, ignore_eos=True,
                        sampling={"temperature": 0.8, "seed": 2})
    try:
        if case == "prompt_rows":  # a session made before (a new one's rows wait for its files: create's case)
            made_before = TurnSpec("completion", "new", prompt=[3, 4], max_tokens=1, ignore_eos=True)
            engine.submit(lambda: engine.run_turn(made_before, TimedSink()), session="new", turn=True).result(60)
        run_fut = engine.submit(lambda: engine.run_turn(run_spec, running), session="run", turn=True)
        assert running.started.wait(60)
        slow.set()
        t0 = time.perf_counter()
        new_fut = engine.submit(lambda: engine.run_turn(new_spec, new), session="new", turn=True)
        assert new.started.wait(60)
        made = new.times[0] - t0
        outcome = new_fut.result(60)  # its files were made (slowly) by then: its turn commits into them
        slow.clear()
        run_fut.result(120)
    finally:
        slow.clear()
        engine.stop()
    if case == "create":  # its files are made while its first turn runs: the slow fsyncs hold up no token
        assert slow_on and at_first == [False], (slow_on, at_first)  # issue 36 part 3
    else:
        assert slow_on and made >= SLOW_S, (slow_on, made)  # the slowed calls did hold up the new turn
    during = [b - a for a, b in zip(running.times, running.times[1:], strict=False) if b > t0 and a < t0 + made]
    assert during, "the running stream had ended before the new turn's first token: raise RUNNING_TOKENS"
    assert max(during) < SLOW_S / 2, f"the running stream stalled {max(during) * 1e3:.0f} ms"
    assert all(name.startswith("coli-engine-io") for name in slow_on), slow_on  # on the loop's I/O threads
    want = reference_turns(model, "fp8", [(prompt, 4)], Sampler(temperature=0.8, seed=2))[0]
    assert outcome.tokens == want and outcome.created == (case == "create")
