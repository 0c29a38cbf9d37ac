"""A disk that fills while serving (issue: durability round 3, part 3): the store on a small tmpfs
this test mounts, 8 sessions streaming at once until the disk is full. Each stream either ends
normally or with one SSE error event in OpenAI's shape, code ``insufficient_storage`` (HTTP 507 for
a request that is not streamed), and then its end; what each session committed is a prefix of its
uninterrupted run; the server stays up and serves a stateless request while the disk is full; once
space is freed every session continues exactly (its next turn equals one uninterrupted run).

Mounting needs root (CI runs as root); elsewhere the test skips and says so."""
from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from kernels.model.sampling import Sampler
from sessionstore.sessions import DURABLE_STREAM, reference_turns
from tests.service.serverkit import ServerProc, sse_events

pytestmark = pytest.mark.timeout(300)

STREAMS = 8
TOKENS = 600  # far more than the disk holds
SAMPLING = {"temperature": 0.8, "seed": 3}


@contextmanager
def small_disk(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` for the block (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    where.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _body(model_id: str, sid: str | None, prompt: list[int], n: int, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model_id, "prompt": prompt, "max_tokens": n, "ignore_eos": True,
                            "stream": stream, **SAMPLING}
    if sid is not None:
        body["session"] = sid
    return body


def _stream(url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    """One streamed turn: its status, text pieces, error event (if any) and whether it ended."""
    pieces: list[str] = []
    with httpx.Client(timeout=240) as client, client.stream("POST", url + "/v1/completions", json=body) as reply:
        out["status"] = reply.status_code
        if reply.status_code != 200:  # refused before any text: the error in OpenAI's shape, no stream
            reply.read()
            out["error"], out["ended"], out["text"] = reply.json()["error"], True, ""
            return
        for event in sse_events(reply):
            if "error" in event:
                out["error"] = event["error"]
                continue
            choice = event["choices"][0]
            pieces.append(choice.get("text") or "")
            if choice.get("finish_reason") is not None:
                out["tokens"] = choice.get("token_ids")
        out["ended"] = True  # [DONE] came (sse_events returns only there)
    out["text"] = "".join(pieces)


OTHER = "--no-durable-stream" if DURABLE_STREAM else "--durable-stream"  # the flag that is not serve's default


@pytest.mark.parametrize("flags", [(), (OTHER,)], ids=["default", OTHER.lstrip("-")])
def test_a_full_disk_ends_turns_with_507_keeps_what_was_committed_and_recovers(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any], flags: tuple[str, ...]) -> None:
    model, tok = text_model
    sampler = Sampler.checked(SAMPLING["temperature"], 0, 1.0, SAMPLING["seed"])
    prompts = [[5, 6, 7 + i] for i in range(STREAMS)]
    with small_disk(tmp_path / "disk", "3m") as disk, \
            ServerProc(disk / "root", text_model_dir, "--commit-every", "4", *flags, log_dir=tmp_path) as server:
        model_id = server.get("/v1/models").json()["data"][0]["id"]
        for i, prompt in enumerate(prompts):  # the sessions exist before the disk fills
            assert server.post("/v1/completions", json=_body(model_id, f"s{i}", prompt, 1)).status_code == 200
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * max(0, free - 60_000))  # room for a few hundred records

        outs: list[dict[str, Any]] = [{} for _ in prompts]
        threads = [threading.Thread(target=_stream, args=(server.url, _body(model_id, f"s{i}", p, TOKENS, True),
                                                          outs[i])) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        full = [o for o in outs if "error" in o]
        assert full, "the disk never filled: no turn was refused"
        for o in outs:  # each streamed until the disk filled (an SSE error event), or was refused before text
            assert o["status"] in (200, 507) and o["ended"], o
            if "error" in o:
                assert o["error"]["code"] == "insufficient_storage" and o["error"]["type"] == "server_error", o
                assert "no space left" in o["error"]["message"] and "/" not in o["error"]["message"], o
            else:
                assert len(o["tokens"]) == TOKENS
        for i, prompt in enumerate(prompts):  # what each session committed: a prefix of its uninterrupted run
            whole = reference_turns(model, "fp8", [(prompt, TOKENS)], sampler)[0]
            history = server.get(f"/v1/sessions/s{i}", params={"history": 1}).json()["history"]
            kept = history[len(prompt):]
            assert history[:len(prompt)] == prompt and kept == whole[:len(kept)], i
            if (OTHER in flags) != DURABLE_STREAM:  # durable streaming: every byte a client was sent is in
                # what its session committed
                assert tok.decode(kept).startswith(outs[i]["text"]), i
            if "error" not in outs[i]:
                assert kept[:TOKENS - 1] == whole[:TOKENS - 1]
        # still serving while the disk is full: a stateless turn writes nothing; a turn that must write is a 507
        stateless = server.post("/v1/completions", json=_body(model_id, None, [1, 2, 3], 4))
        assert stateless.status_code == 200, stateless.text
        history = server.get("/v1/sessions/s0", params={"history": 1}).json()["history"]
        refused = server.post("/v1/completions", json=_body(model_id, "s0", history + [1], 300))
        assert refused.status_code == 507, refused.text
        assert refused.json()["error"]["code"] == "insufficient_storage"
        assert server.get("/healthz").status_code == 200

        (disk / "filler").unlink()
        for i in range(STREAMS):  # space again: every session continues from what it committed, exactly
            history = server.get(f"/v1/sessions/s{i}", params={"history": 1}).json()["history"]
            nxt = history + [9, 8]
            reply = server.post("/v1/completions", json=_body(model_id, f"s{i}", nxt, 6))
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["token_ids"] == reference_turns(model, "fp8", [(nxt, 6)], sampler)[0]
