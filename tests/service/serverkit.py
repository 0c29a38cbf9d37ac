"""A real ``coli-kv serve --http`` process on loopback for tests: started on a port the OS picks
(printed by the server), ready once ``/healthz`` answers, stopped by SIGTERM or SIGKILL."""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
POLL_S = 0.02  # between readiness probes


class ServerProc:
    """One server process; ``url`` once started."""

    def __init__(self, root: Path, model: Path | str, *args: str, log_dir: Path | None = None,
                 env: dict[str, str] | None = None, port: int = 0, module: str = "tools") -> None:
        self.root, self.model, self.args = root, str(model), list(args)
        self.module = module  # what ``python -m`` runs: the CLI, or a test's launcher of it (faults injected)
        self.port = port  # 0: one the OS picks
        self.log_dir = log_dir or root.parent
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.api_key: str | None = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self._n = 0

    def start(self) -> ServerProc:
        self._n += 1
        self.stderr_path = self.log_dir / f"server-{os.getpid()}-{id(self)}-{self._n}.stderr"
        cmd = [sys.executable, "-m", self.module, "serve", "--http", f"127.0.0.1:{self.port}", "--root", str(self.root),
               "--model", self.model, *self.args]
        env = {**os.environ, "COLI_LOG": "off", "PYTHONPATH": str(REPO), **(self.env or {})}
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, env=env)
        line = self._first_line()
        self.url = json.loads(line)["url"]
        self._wait_healthy()
        return self

    def _first_line(self) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                raise AssertionError(f"server printed nothing in {START_TIMEOUT_S}s: {self.stderr()}")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise AssertionError(f"server exited ({self.proc.wait()}): {self.stderr()}")
            buf += chunk
        return buf.split(b"\n", 1)[0]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # readiness by polling, never a fixed sleep
            try:
                if httpx.get(self.url + "/healthz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc is None or self.proc.poll() is not None:
                raise AssertionError(f"server never became healthy: {self.stderr()}")
            time.sleep(POLL_S)  # a poll, not a wait for time to pass: a busy loop here takes a core from the server

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=60, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        kw.setdefault("headers", self.headers())
        return httpx.post(self.url + path, timeout=120, **kw)

    def openai(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=120)

    def stop(self, sig: int = signal.SIGTERM, *, api_only: bool = False) -> int:
        """Signal the server and wait for it; its exit status. SIGKILL is a crash of the whole
        server: its engine core is SIGKILLed first, then the API process (``api_only``: the API
        process alone, whose core then commits and exits on its own)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            if sig == signal.SIGKILL and not api_only:
                for child in children_of(self.proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child, signal.SIGKILL)
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return rc

    def __enter__(self) -> ServerProc:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop(signal.SIGKILL)


class StreamReader:
    """One streamed request read in a thread: the text its events carried, in order, and its
    error event if any (a SIGKILL ending the connection is no error here: it is what is tested)."""

    def __init__(self, server: ServerProc, path: str, body: dict[str, Any]) -> None:
        self.text = ""
        self.events = 0
        self.error: dict[str, Any] | None = None
        self.tokens: list[int] | None = None  # the final event's token_ids, when the turn ended
        self.status = 0  # the response's HTTP status (0: none came)
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(server.url + path, body))
        self.thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=120) as response:
                self.status = response.status_code
                for event in sse_events(response):
                    if "error" in event:
                        self.error = event["error"]
                        continue
                    choice = event["choices"][0]
                    if choice.get("finish_reason") is not None:
                        self.tokens = choice.get("token_ids")
                    piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if piece:
                        self.text += piece
                        self.events += 1
                        self.started.set()
        except httpx.HTTPError:
            pass  # SIGKILL: the connection dies mid-stream
        finally:
            self.started.set()


def children_of(pid: int) -> list[int]:
    """The child processes of ``pid`` (every thread's, from /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def free_port() -> int:
    """A loopback port free now (for a server that must know its own URL before it starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sse_events(response: httpx.Response) -> Any:
    """The JSON objects of a streamed response, in order (``[DONE]`` ends it)."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)
