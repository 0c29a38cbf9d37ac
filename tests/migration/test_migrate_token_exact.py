"""Token-exact after migration: generate on host A, export, import on host B, resume, continue:
identical to the uninterrupted run (tiny model; f32 and fp8; greedy and sampled).

In-process: the full matrix through a file and an OS pipe (two stores, two roots). Subprocess:
host A and host B are separate processes with separate roots, the bundle moving through a file,
a shell pipe (`export - | import -`) and a real S3 API server (moto on 127.0.0.1)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kernels.model.sampling import Sampler
from sessionstore.migration import export_session, migrate
from sessionstore.sessions import SessionOptions
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turn_loop import reference_turns
from tests.support.migrate import S3_BUCKET, s3_endpoint  # noqa: F401

PROMPT = [3, 17, 101, 5, 42, 7, 250, 9]
FIRST, SECOND = 9, 7
GREEDY = Sampler()
SAMPLED = Sampler(temperature=0.9, top_k=40, top_p=0.95, seed=1234)
REPO = Path(__file__).resolve().parents[2]



def _reference(model, kv, sampler) -> list[list[int]]:
    return reference_turns(model, kv, [(PROMPT, FIRST), (None, SECOND)], sampler)


def _move(a: SessionStore, b: SessionStore, sid: str, transport: str) -> None:
    if transport == "file":
        path = a.root.parent / f"{sid}.colibundle"
        with open(path, "wb") as sink:
            export_session(a, sid, sink)
        with open(path, "rb") as source:
            migrate.import_bundle(b, source, source_name=str(path), model="tiny")
        return
    r, w = os.pipe()
    errors: list[BaseException] = []

    def produce() -> None:
        with os.fdopen(w, "wb") as sink:
            try:
                export_session(a, sid, sink, compression=1)
            except BaseException as exc:  # pragma: no cover - asserted below
                errors.append(exc)

    thread = threading.Thread(target=produce)
    thread.start()
    with os.fdopen(r, "rb") as source:
        migrate.import_bundle(b, source, source_name="<pipe>", model="tiny")
    thread.join()
    assert not errors


@pytest.mark.parametrize("transport", ["file", "pipe"])
@pytest.mark.parametrize("sampler", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kv", ["f32", "fp8", "int4"])
def test_migrated_session_continues_token_exact(tmp_path, tiny, kv, sampler, transport):
    expected = _reference(tiny, kv, sampler)
    a, b = SessionStore(tmp_path / "hostA"), SessionStore(tmp_path / "hostB")
    session = a.create("m", "tiny", kv_dtype=kv, sampler=sampler, options=SessionOptions(commit_every=4))
    first = session.generate(PROMPT, FIRST).tokens
    session.suspend()
    session.close()
    _move(a, b, "m", transport)
    resumed = b.open("m")
    try:
        second = resumed.generate(None, SECOND).tokens
    finally:
        resumed.close()
    assert [first, second] == expected


@pytest.mark.parametrize("kv", ["f32", "fp8", "int4"])
def test_export_of_a_live_session_continues_token_exact(tmp_path, tiny, kv):
    """Host A keeps the session open (live, lock held) while it is exported."""
    expected = _reference(tiny, kv, SAMPLED)
    a, b = SessionStore(tmp_path / "hostA"), SessionStore(tmp_path / "hostB")
    session = a.create("live", "tiny", kv_dtype=kv, sampler=SAMPLED, options=SessionOptions(commit_every=0))
    try:
        first = session.generate(PROMPT, FIRST).tokens  # committed at the end of the turn
        sink = io.BytesIO()
        export_session(a, "live", sink)
    finally:
        session.close()
    migrate.import_bundle(b, io.BytesIO(sink.getvalue()))
    resumed = b.open("live")
    try:
        second = resumed.generate(None, SECOND).tokens
    finally:
        resumed.close()
    assert [first, second] == expected


# --- separate processes ----------------------------------------------------------------------
def _cli(*args: str, stdin: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools", *args], cwd=REPO, input=stdin,
                          capture_output=True, timeout=120, env=env)


def _last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def _sampler_args(sampler: Sampler) -> list[str]:
    return ["--temperature", str(sampler.temperature), "--top-k", str(sampler.top_k),
            "--top-p", str(sampler.top_p), "--seed", str(sampler.seed)]


def _host_a(root: Path, kv: str, sampler: Sampler, env=None) -> list[int]:
    out = _last_json(_cli("generate", "--model", "tiny", "--root", str(root), "--session", "m",
                          "--kv", kv, "--prompt-ids", ",".join(map(str, PROMPT)),
                          "--max-new", str(FIRST), "--commit-every", "4", *_sampler_args(sampler),
                          "--json", env=env))
    return out["tokens"]


def _host_b(root: Path, history: list[int], sampler: Sampler, env=None) -> list[int]:
    """Continue on host B: the full history as the prompt (its prefix is reused; the pending
    token is fed), exactly what the uninterrupted run's continuation feeds. The sampler flags
    are repeated: `generate`'s flags carry defaults, which would override the session's."""
    out = _last_json(_cli("generate", "--root", str(root), "--session", "m",
                          "--prompt-ids", ",".join(map(str, history)), "--max-new", str(SECOND),
                          *_sampler_args(sampler), "--json", env=env))
    assert out["reused_prefix"] == len(history) - 1
    return out["tokens"]


def _subprocess_case(tmp_path, tiny, kv, sampler, move) -> None:
    expected = _reference(tiny, kv, sampler)
    first = _host_a(tmp_path / "hostA", kv, sampler)
    move(tmp_path / "hostA", tmp_path / "hostB")
    second = _host_b(tmp_path / "hostB", PROMPT + first, sampler)
    assert [first, second] == expected


def test_processes_through_a_file_f32_greedy(tmp_path, tiny):
    def move(a: Path, b: Path) -> None:
        bundle = tmp_path / "m.colibundle"
        assert _cli("export", "--root", str(a), "m", str(bundle)).returncode == 0
        _last_json(_cli("import", "--root", str(b), str(bundle), "--model", "tiny", "--json"))

    _subprocess_case(tmp_path, tiny, "f32", GREEDY, move)


def test_processes_through_a_pipe_fp8_sampled(tmp_path, tiny):
    def move(a: Path, b: Path) -> None:
        cmd = (f"{sys.executable} -m tools export --root {a} m - --compress 1 | "
               f"{sys.executable} -m tools import --root {b} - --json")
        proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=REPO, capture_output=True,
                              timeout=120)
        assert _last_json(proc)["tokens"] == 1 + len(PROMPT) + FIRST - 2

    _subprocess_case(tmp_path, tiny, "fp8", SAMPLED, move)


def test_processes_through_s3_fp8_greedy(tmp_path, tiny, s3_endpoint):
    url = f"s3://{S3_BUCKET}/exact/m.colibundle"

    def move(a: Path, b: Path) -> None:
        assert _cli("export", "--root", str(a), "m", url).returncode == 0
        _last_json(_cli("import", "--root", str(b), url, "--model", "tiny", "--json"))

    _subprocess_case(tmp_path, tiny, "fp8", GREEDY, move)


def test_processes_through_s3_push_pull_f32_sampled(tmp_path, tiny, s3_endpoint):
    remote = f"s3://{S3_BUCKET}/fleet-exact"

    def move(a: Path, b: Path) -> None:
        pushed = _last_json(_cli("push", "--root", str(a), "--remote", remote, "--host-id", "A",
                                 "m", "--json"))
        assert pushed["lease"]["released"]
        pulled = _last_json(_cli("pull", "--root", str(b), "--remote", remote, "--host-id", "B",
                                 "m", "--json"))
        assert pulled["lease"]["owner"] == "B" and pulled["lease"]["live"]
        # host A can no longer take the session while B holds it
        refused = _cli("pull", "--root", str(a), "--remote", remote, "--host-id", "A", "m",
                       "--replace")
        assert refused.returncode == 4 and b"held live by host 'B'" in refused.stderr

    _subprocess_case(tmp_path, tiny, "f32", SAMPLED, move)
