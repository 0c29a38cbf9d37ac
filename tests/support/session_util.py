"""Helpers for the session tests: a child-process runner and a tiny checkpoint on disk.

Run as ``python -m tests.support.session_util '<json spec>'``: opens (or creates) the
sessions named in the spec, runs one turn each, closes them and prints one JSON line with the
tokens. Fault options make the child die for real (SIGKILL) at chosen points.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def write_tiny_checkpoint(directory: Path, seed: int | None = None) -> Path:
    """config.json + model.safetensors of the tiny model (other weights with another ``seed``)."""
    from safetensors.numpy import save_file

    from kernels.model.tiny import TINY_SEED, tiny_config, tiny_config_dict, tiny_weights

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_config_dict()))
    save_file(tiny_weights(tiny_config(), TINY_SEED if seed is None else seed),
              str(directory / "model.safetensors"))
    return directory


def run_child(spec: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
    """Run the spec in a fresh Python process; returns its JSON result (raises on failure)."""
    proc = subprocess.run([sys.executable, "-m", "tests.support.session_util", json.dumps(spec)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLI_LOG": "off"})
    if proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spawn_child(spec: dict[str, Any]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.support.session_util", json.dumps(spec)],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLI_LOG": "off"})


def _slow_starter(delay_s: float) -> Any:
    """An io_start whose makings begin ``delay_s`` late on a thread (a slow disk), printing
    ``made`` once the files are there."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)

    def start(fn: Any) -> Any:
        def slow() -> Any:
            time.sleep(delay_s)
            made = fn()
            print("made", flush=True)
            return made

        return pool.submit(slow)

    return start


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    from kernels.model.sampling import Sampler
    from sessionstore.sessions import SessionOptions
    from sessionstore.sessions import recovery as recovery_mod
    from sessionstore.sessions import session_turns as turns_mod
    from sessionstore.sessions import store as store_mod
    from sessionstore.sessions.store import SessionStore

    store = SessionStore(spec["root"])
    kill_manifest = spec.get("kill_at_manifest_write")  # SIGKILL at the n-th manifest write
    if kill_manifest is not None:  # (a whole manifest, or a commit's state page)
        from sessionstore.sessions.commit_state_page import StateWriter

        real, real_state = turns_mod.write_manifest, StateWriter.write_page
        calls = {"n": 0}

        def dying() -> None:
            calls["n"] += 1
            if calls["n"] == kill_manifest:
                os.kill(os.getpid(), signal.SIGKILL)

        def dying_write(path: Any, manifest: Any, **kw: Any) -> None:
            dying()
            real(path, manifest, **kw)

        def dying_state(self: Any, page: bytes, **kw: Any) -> None:
            dying()
            real_state(self, page, **kw)

        # a session's whole manifest writes: creation (store), recovery, sampler change and truncate
        for mod in (turns_mod, store_mod, recovery_mod):
            mod.write_manifest = dying_write  # type: ignore[attr-defined]
        StateWriter.write_page = dying_state  # type: ignore[method-assign]
    if spec.get("kill_at_kv_truncate"):  # SIGKILL after the manifest's epoch bump, before the cut
        from sessionstore.kvfile.writer import KVWriter

        KVWriter.truncate = lambda self, n: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    results = {}
    for job in spec["jobs"]:
        options = SessionOptions(commit_every=job.get("commit_every", 64))
        behind = job.get("create_behind")  # {"delay_s": s}: the files made on a thread, that much later
        if behind is not None:
            options = dataclasses.replace(options, io_start=_slow_starter(float(behind["delay_s"])))
        if job.get("create"):
            c = job["create"]
            s = store.create(job["id"], c.get("model", "tiny"), kv_dtype=c["kv"],
                             sampler=Sampler(*c.get("sampler", (0.0, 0, 1.0, 0))), options=options)
        else:
            s = store.open(job["id"], job.get("model"), options)
        if spec.get("announce"):
            print("ready", flush=True)
        if spec.get("hold"):  # keep the session (and its writer lock) until stdin closes
            sys.stdin.read()

        def on_token(token: int, position: int) -> None:
            if spec.get("stream"):
                print(f"tok {token} {position}", flush=True)

        r = s.generate(job.get("prompt"), job["max_new"], on_token=on_token)
        s.close()
        results[job["id"]] = {"tokens": r.tokens, "resume": {k: v for k, v in s.resume_report.items()
                                                                if k in ("verified", "recovered")}}
    return results


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
