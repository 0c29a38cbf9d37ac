"""``coli-kv generate`` and ``chat`` run their turns on the engine core in process (issue 23 part
3): every batched step runs on the engine loop's thread, the commits through its commit runner
(its I/O and group-commit threads), the tokens are those of the plain in-memory run, and the loop's
threads are gone when the command returns, whether it succeeded or failed.

The commands run in this process (``tools.coli_kv.main``) so the decoder's ``step`` and a
session's commit path (``CommitPath.begin``) can be watched: each call notes the thread it ran on. Before the
engine core the CLI ran every forward and every commit on the main thread, and these tests fail.
"""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels.model import Sampler, generate, load_model
from kernels.model.decoder import MLADecoder
from sessionstore.sessions import SessionStore, reference_turns
from sessionstore.sessions.session_commits import CommitPath
from tools.coli_kv import main

REPO = Path(__file__).resolve().parents[2]

LOOP_THREAD = "coli-engine"  # EngineLoop's thread
COMMIT_THREADS = ("coli-engine-io", "coli-commit")  # its I/O threads, and GroupCommit's pool


class Watch:
    """The threads the decoder's batched steps and the sessions' commits ran on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[tuple[str, list[int]]] = []  # (thread, tokens per session) of each step
        self.commits: list[str] = []  # the thread each commit's second part ran on
        step, begin_commit = MLADecoder.step, CommitPath.begin

        def watched_step(model: MLADecoder, caches: Any, tokens: np.ndarray, counts: Any) -> np.ndarray:
            self.steps.append((threading.current_thread().name, [int(c) for c in counts]))
            return step(model, caches, tokens, counts)

        def watched_begin_commit(path: CommitPath, *args: Any, **kw: Any) -> Callable[[], int]:
            finish = begin_commit(path, *args, **kw)

            def watched_finish() -> int:
                self.commits.append(threading.current_thread().name)
                return finish()

            return watched_finish

        monkeypatch.setattr(MLADecoder, "step", watched_step)
        monkeypatch.setattr(CommitPath, "begin", watched_begin_commit)

    def decode_steps(self) -> int:
        return sum(1 for _, counts in self.steps if counts == [1])

    def check_on_loop(self, *, commits: bool) -> None:
        assert self.steps, "no batched step ran"
        assert {thread for thread, _ in self.steps} == {LOOP_THREAD}, self.steps
        if commits:
            assert self.commits, "no commit ran"
            # a turn's commits: by the loop's commit runner; a session's close: in its job, on the loop
            assert all(name.startswith((LOOP_THREAD, *COMMIT_THREADS)) for name in self.commits), self.commits
            assert any(name.startswith(COMMIT_THREADS) for name in self.commits), self.commits


def loop_threads() -> set[threading.Thread]:
    """The engine loops' threads alive now (a command's must be gone once it returns)."""
    return {t for t in threading.enumerate() if t.name.startswith((LOOP_THREAD, "coli-commit"))}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``coli-kv ARGV`` here: (exit code, stdout, stderr); no engine thread it started outlives it."""
    before = loop_threads()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert loop_threads() <= before, loop_threads() - before
    return rc, out, err


def test_stateless_generate_runs_on_the_loop(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    want = generate(load_model("tiny"), load_model("tiny").new_cache("f32"), [1, 2, 3], 12, Sampler()).tokens
    watch = Watch(monkeypatch)
    rc, out, err = run(capsys, "generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-new", "12", "--json")
    assert rc == 0, err
    assert json.loads(out.splitlines()[-1])["tokens"] == want
    watch.check_on_loop(commits=False)
    assert watch.decode_steps() == 11  # each token drawn but the last
    assert [counts for _, counts in watch.steps if counts != [1]] == [[3]]  # the prompt: one step, whole


def test_session_generate_runs_on_the_loop_and_commits_through_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "store")
    want = reference_turns(load_model("tiny"), "fp8", [([5, 6, 7, 8], 10), (None, 7)], Sampler(temperature=0.8, seed=3))
    watch = Watch(monkeypatch)
    got = []
    for extra in (["--model", "tiny", "--prompt-ids", "5,6,7,8", "--max-new", "10", "--temperature", "0.8",
                   "--seed", "3"], ["--max-new", "7"]):  # the second continues with the manifest's sampler
        rc, out, err = run(capsys, "generate", "--root", root, "--session", "s", "--commit-every", "3", "--json",
                           *extra)
        assert rc == 0, err
        got.append(json.loads(out.splitlines()[-1])["tokens"])
    assert got == want
    watch.check_on_loop(commits=True)
    assert any(name.startswith("coli-commit") for name in watch.commits)  # mid-turn commits: the group commit


def test_a_failed_turn_stops_the_loop_with_one_error_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "store")
    rc, _, err = run(capsys, "generate", "--root", root, "--session", "s", "--model", "tiny",
                     "--prompt-ids", "1,2", "--max-new", "100000")
    assert rc != 0 and err.count("\n") == 1 and "error:" in err and "Traceback" not in err, err


def test_chat_replies_run_on_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tokenizers", reason="the text extra (tokenizers) builds the test tokenizer")
    from kernels.model.text import load_text
    from sessionstore.sessions.conversation_chat import ReferenceChat
    from tests.kernels.model.text.textkit import write_text_model

    model_dir = write_text_model(tmp_path / "model", "glm")
    ref = ReferenceChat(load_model(model_dir), load_text(model_dir), "fp8")
    first = ref.respond([{"role": "user", "content": "Hello there"}], 20)
    watch = Watch(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n/regenerate\n/quit\n"))
    rc, out, err = run(capsys, "chat", "--root", str(tmp_path / "store"), "--session", "c", "--model", str(model_dir),
                       "--max-new", "20", "--commit-every", "4", "--json")
    assert rc == 0, err
    replies = [json.loads(line)["reply"] for line in out.splitlines() if '"reply"' in line]
    assert [r["tokens"] for r in replies] == [first, first]  # /regenerate draws the same greedy reply
    watch.check_on_loop(commits=True)
    assert watch.decode_steps() >= 2 * (len(first) - 1)


def test_ctrl_c_while_waiting_for_input_ends_the_chat(tmp_path: Path) -> None:
    """A real process: SIGINT at the prompt ends the chat at once, exit 0, the loop stopped (no
    hang on its threads), the reply before it committed."""
    pytest.importorskip("tokenizers", reason="the text extra (tokenizers) builds the test tokenizer")
    from tests.kernels.model.text.textkit import write_text_model

    model_dir = write_text_model(tmp_path / "model", "glm")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.Popen([sys.executable, "-m", "tools.coli_kv", "chat", "--root", str(tmp_path / "store"),
                             "--session", "c", "--model", str(model_dir), "--json", "--max-new", "8"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            env=env, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    assert json.loads(proc.stdout.readline())["event"] == "open"
    proc.stdin.write("Hello there\n")
    proc.stdin.flush()
    while "reply" not in (event := json.loads(proc.stdout.readline())):
        pass
    proc.send_signal(signal.SIGINT)  # waiting for the next line now
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    reply = event["reply"]
    assert len(SessionStore(tmp_path / "store").history("c")) == reply["prompt_tokens"] + len(reply["tokens"])
