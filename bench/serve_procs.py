"""bench/serve.py's plumbing: real ``coli-kv serve --http`` processes on loopback (a port the OS
picks, ready once ``/healthz`` answers), streamed requests timed event by event, the server's
Prometheus counters and its JSON log lines."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0


class Server:
    """One server process over ``root`` serving ``model``; ``url`` once started. Its stderr
    (JSON log lines with ``log_json``) goes to a file beside the store. ``repo``: the checkout
    whose code it runs (another one: a baseline measured in the same run)."""

    def __init__(self, root: Path, model: str, *args: str, log_json: bool = False, repo: Path = REPO) -> None:
        self.root, self.model, self.args, self.log_json = root, model, list(args), log_json
        self.repo = repo
        self.stderr_path = root.parent / f"{root.name}.stderr"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.model_id = ""  # the name requests give as "model" (GET /v1/models)

    def start(self) -> Server:
        cmd = [sys.executable, "-m", "tools", "serve", "--http", "127.0.0.1:0", "--root", str(self.root),
               "--model", self.model, *self.args]
        env = {**os.environ, "COLI_LOG": "json" if self.log_json else "off", "PYTHONPATH": str(self.repo)}
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=self.repo, stdout=subprocess.PIPE, stderr=err, env=env)
        self.url = json.loads(self._first_line())["url"]
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # ready by polling /healthz, never a fixed sleep
            try:
                if httpx.get(self.url + "/healthz", timeout=5).status_code == 200:
                    self.model_id = self.call("GET", "/v1/models")["data"][0]["id"]
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"server never became healthy: {self.stderr()}")
            time.sleep(0.05)

    def _first_line(self) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        deadline, buf = time.monotonic() + START_TIMEOUT_S, b""
        while b"\n" not in buf:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                raise RuntimeError(f"server printed nothing in {START_TIMEOUT_S}s: {self.stderr()}")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"server exited ({self.proc.wait()}): {self.stderr()}")
            buf += chunk
        return buf.split(b"\n", 1)[0]

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def log_events(self, name: str) -> list[dict[str, Any]]:
        """The server's JSON log lines whose event is ``name``, in order."""
        out = []
        for line in self.stderr_path.read_text(errors="replace").splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("event") == name:
                out.append(obj)
        return out

    def metric(self, name: str) -> float:
        """One sample of ``GET /metrics`` (e.g. ``coli_resume_seconds_sum``)."""
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"the server exports no metric {name!r}")

    def call(self, method: str, path: str, **kw: Any) -> Any:
        """A JSON request that must succeed; its JSON body."""
        r = httpx.request(method, self.url + path, timeout=600, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:500]}")
        return r.json()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Streamed:
    """One streamed request: when it was sent, the arrival time of each text event, the final
    chunk (``token_ids``, ``usage``, ``session``) and when it came."""

    sent: float
    text_times: list[float] = field(default_factory=list)
    first_event: float = 0.0
    done: float = 0.0
    final: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        ids: list[int] = self.final["choices"][0]["token_ids"]
        return ids

    def event(self, data: str | bytes, now: float) -> bool:
        """One ``data:`` payload that arrived at ``now``; True at ``[DONE]``."""
        self.first_event = self.first_event or now
        if data in ("[DONE]", b"[DONE]"):
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"completion failed mid-stream: {chunk['error']}")
        choice = chunk["choices"][0]
        if choice.get("finish_reason") is not None:
            self.final, self.done = chunk, now
        elif choice.get("text"):
            self.text_times.append(now)
        return False

    def ended(self) -> Streamed:
        if not self.final:
            raise RuntimeError("the stream ended without a final chunk")
        return self


def stream_completion(client: httpx.Client, url: str, body: dict[str, Any]) -> Streamed:
    """POST a streamed ``/v1/completions`` and time its events (perf_counter seconds)."""
    out = Streamed(time.perf_counter())
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"completion: {r.status_code} {r.read()[:500]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and out.event(line[len("data: "):], time.perf_counter()):
                break
    return out.ended()


__all__ = ["REPO", "Server", "Streamed", "stream_completion"]
