"""bench.peer's two servers behind one face: ours (``coli-kv serve --http``, bench.serve_procs.Server)
and llama.cpp's ``llama-server`` on the converted glm-mini; each knows its request bodies and how
it suspends and resumes a session (ours: ``/v1/sessions/{id}/suspend`` and the next request;
llama.cpp: ``/slots/0?action=save``, ``erase``, then ``restore`` + the next request)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.peer_client import PeerError, Reply, stream_one
from bench.serve_procs import Server

START_TIMEOUT_S = 120.0
FED = 100  # the one new token fed after a resume (an ordinary id, no special token)


class Side:
    """One server, as the bench drives it: ``url``, request bodies, suspend/resume."""

    name = ""
    url = ""
    kv = ""
    model_name = ""  # what requests name as "model"

    def body(self, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
        """A greedy, ``ignore_eos`` completion of ``prompt`` (token ids)."""
        return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The greedy continuation's token ids."""
        raise NotImplementedError

    def suspend(self, key: str, prompt: list[int]) -> None:
        """Build a session holding ``prompt`` (one token sampled), then suspend it."""
        raise NotImplementedError

    def resume(self, key: str, prompt: list[int]) -> float:
        """Seconds from asking for the suspended session to its first new token."""
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        """The server's process (its children are the server's too), once started."""
        return None


RESIDENT = 16  # llama.cpp's slots (``-np``) and the sessions ours keeps resident (``--max-resident``): 16 caches a side


class Ours(Side):
    """``coli-kv serve --http`` over a fresh root (``--kv`` as given), ``--max-resident`` as many
    sessions as llama.cpp has slots (the default, 8, suspends and resumes the multi-turn run's 16
    conversations turn after turn while llama.cpp keeps 16 slots: BENCHMARKS.md, session 30)."""

    name = "ours"

    def __init__(self, root: Path, model: str, kv: str) -> None:
        self.kv = kv
        self.server = Server(root, model, "--kv", kv, "--max-resident", str(RESIDENT))
        try:
            self.server.start()
        except BaseException:
            self.server.stop()  # a start that timed out leaves its process running
            raise
        self.url, self.model_name = self.server.url, self.server.model_id

    def body(self, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
        return super().body(prompt, max_tokens, model=self.server.model_id, **extra)

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        return stream_one(self.url, self.body(prompt, max_tokens)).token_ids

    def suspend(self, key: str, prompt: list[int]) -> None:
        stream_one(self.url, self.body(prompt, 1, session=key))
        self.server.call("POST", f"/v1/sessions/{key}/suspend")

    def resume(self, key: str, prompt: list[int]) -> float:
        info = self.server.call("GET", f"/v1/sessions/{key}?history=1")
        history: list[int] = info["history"]  # the prompt, its sampled token (pending or committed)
        feed = history if info["tokens"] > info["committed"] else [*history, FED]
        reply = stream_one(self.url, self.body(feed, 1, session=key))
        return reply.ttft

    def stop(self) -> None:
        self.server.stop()

    @property
    def pid(self) -> int | None:
        return self.server.proc.pid if self.server.proc is not None else None  # the API process; the core its child


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Llama(Side):
    """``llama-server`` on the gguf: 16 slots of 2,048 tokens each (every stream of the bench at
    once), KV cache type ``kv`` (``f16`` or ``f32``), slot files under a temporary folder; ``threads``
    (``-t``/``-tb``) when given, else llama.cpp's default (one per core)."""

    name = "llama.cpp"

    def __init__(self, binary: Path, gguf: Path, kv: str, scratch: Path, threads: int | None = None) -> None:
        self.kv, self.model_name = kv, gguf.stem
        self.slots = Path(tempfile.mkdtemp(prefix="slots-", dir=scratch))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = scratch / f"llama-server-{port}.log"
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(RESIDENT),
               "-c", str(RESIDENT * 2048), "-ctk", kv, "-ctv", kv, "--slot-save-path", str(self.slots),
               "--no-webui", *(["-t", str(threads), "-tb", str(threads)] if threads else [])]
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # ready once /health says ok (503 while the model loads)
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise PeerError(f"llama-server never became healthy: {self.tail()}")
            time.sleep(0.05)

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def post(self, path: str, body: dict[str, Any]) -> Any:
        r = httpx.post(self.url + path, json=body, timeout=600)
        if r.status_code != 200:
            raise PeerError(f"llama-server {path}: {r.status_code} {r.text[:300]}")
        return r.json()

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True}
        reply: Reply = stream_one(self.url, body, path="/completion")
        return reply.token_ids

    def suspend(self, key: str, prompt: list[int]) -> None:
        stream_one(self.url, self.body(prompt, 1, id_slot=0, cache_prompt=True))
        self.post("/slots/0?action=save", {"filename": key})
        self.post("/slots/0?action=erase", {})

    def resume(self, key: str, prompt: list[int]) -> float:
        sent = time.perf_counter()
        self.post("/slots/0?action=restore", {"filename": key})
        reply = stream_one(self.url, self.body([*prompt, FED], 1, id_slot=0, cache_prompt=True))
        return reply.token_times[0] - sent

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    @property
    def pid(self) -> int | None:
        return self.proc.pid


__all__ = ["FED", "Llama", "Ours", "Side", "free_port"]
