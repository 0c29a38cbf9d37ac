"""EIO from fsync while serving (issue 26 part 3): a real server whose durability seam fails one
fsync of one session's kv file with EIO, right after that file's commit word was written (so the
page cache counts records the disk may not hold), while four sessions stream at once.

That session is fenced: its stream ends with one SSE error event (``session_fenced``); nothing more
is written to its files and no fsync of them follows the failed one (never retried as if it had
succeeded); ``/healthz`` says ``degraded`` and names it with its verified count, the metrics count
it. The three other streams finish exactly as uninterrupted runs. The next request on the fenced
session reopens it from its last verified commit only (the records the failed commit word counted
are cut: the request reuses exactly the verified count), everything its client had been sent is
in that committed reply (``--durable-stream``), and it continues exactly; ``/healthz`` is ``ok``
again. The same holds when the server is restarted before that request: the fence was written
beside the session (``fence.json``), and the new process cuts back from it."""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from kernels.model.sampling import Sampler
from sessionstore.sessions import reference_turns
from tests.service.serverkit import ServerProc, sse_events

BAD = "bad"
GOOD = ["g1", "g2", "g3"]
AFTER = 4  # the fsync after the bad session's 4th commit word fails (its prompt's commit is the first)
BAD_TOKENS = 150
GOOD_TOKENS = 60
SAMPLING = {"temperature": 0.8, "top_p": 0.9}


def _prompt(i: int) -> list[int]:
    return [7 + i, 40, 41 + 3 * i, 200, 9]


def _stream(url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    out["text"], out["errors"] = "", []
    with httpx.Client(timeout=240) as client, client.stream("POST", url + "/v1/completions", json=body) as reply:
        out["status"] = reply.status_code
        for event in sse_events(reply):
            if "error" in event:
                out["errors"].append(event["error"])
                continue
            choice = event["choices"][0]
            out["text"] += choice.get("text") or ""
            if choice.get("finish_reason") is not None:
                out["tokens"] = choice["token_ids"]


def _files_digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()
            and not p.name.endswith(".lock")}


def _metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


@pytest.mark.parametrize("restart", [False, True], ids=["same-server", "after-restart"])
def test_eio_from_fsync_fences_only_that_session_which_reopens_from_its_verified_commit(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any], restart: bool) -> None:
    model, tok = text_model
    log = tmp_path / "fsyncs.log"
    env = {"COLI_TEST_EIO_SESSION": BAD, "COLI_TEST_EIO_AFTER": str(AFTER), "COLI_TEST_EIO_LOG": str(log)}
    server = ServerProc(tmp_path / "root", text_model_dir, "--durable-stream", module="tests.support.eio_serve",
                        env=env).start()
    try:
        name = server.get("/v1/models").json()["data"][0]["id"]
        bodies = {BAD: {"model": name, "prompt": _prompt(0), "max_tokens": BAD_TOKENS, "ignore_eos": True,
                        "stream": True, "session": BAD, "temperature": 0}}
        for i, sid in enumerate(GOOD, start=1):
            bodies[sid] = {"model": name, "prompt": _prompt(i), "max_tokens": GOOD_TOKENS, "ignore_eos": True,
                           "stream": True, "session": sid, **SAMPLING, "seed": i}
        outs: dict[str, dict[str, Any]] = {sid: {} for sid in bodies}
        threads = [threading.Thread(target=_stream, args=(server.url, bodies[sid], outs[sid])) for sid in bodies]
        for th in threads:
            th.start()
        threads[0].join()  # the fenced stream ends first (its error event, then its end)
        bad_dir = tmp_path / "root" / "sessions" / BAD
        fenced_files = _files_digest(bad_dir)
        for th in threads[1:]:
            th.join()

        bad = outs[BAD]
        assert bad["status"] == 200 and len(bad["errors"]) == 1, bad
        assert bad["errors"][0]["code"] == "session_fenced", bad["errors"]
        assert "/" not in bad["errors"][0]["message"]  # no server path
        for i, sid in enumerate(GOOD, start=1):  # the others: untouched, exact
            assert not outs[sid]["errors"], outs[sid]
            want = reference_turns(model, "fp8", [(_prompt(i), GOOD_TOKENS)], Sampler(**SAMPLING, seed=i))[0]
            assert outs[sid]["tokens"] == want, sid

        health = server.get("/healthz")
        assert health.status_code == 200
        report = health.json()
        assert report["status"] == "degraded"
        [fence] = report["fenced"]
        assert fence["id"] == BAD and fence["error"] == "EIO"
        verified = int(fence["verified"])
        assert len(_prompt(0)) <= verified < len(_prompt(0)) + BAD_TOKENS
        metrics = server.get("/metrics").text
        assert _metric(metrics, "coli_sessions_fenced") == 1
        assert _metric(metrics, "coli_session_fences_total") == 1

        # nothing more written for it, and the failed fsync never retried
        assert _files_digest(bad_dir) == fenced_files
        lines = log.read_text().splitlines()
        assert lines[-1].endswith(" EIO") and sum(line.endswith(" EIO") for line in lines) == 1, lines

        assert (bad_dir / "fence.json").exists()  # recorded beside it: any later open cuts back first
        if restart:  # a new process (no fault, no memory of the fence) reopens it from fence.json
            assert server.stop() == 0
            server = ServerProc(tmp_path / "root", text_model_dir, "--durable-stream").start()
        # reopened from its verified commit only: the greedy run's tokens as far as it goes
        want = reference_turns(model, "fp8", [(_prompt(0), BAD_TOKENS + 60)], Sampler())[0]
        ask = _prompt(0) + want[:BAD_TOKENS + 40]  # past anything it committed
        more = server.post("/v1/completions", json={"model": name, "prompt": ask, "max_tokens": 8,
                                                    "ignore_eos": True, "session": BAD, "temperature": 0})
        assert more.status_code == 200, more.text
        assert more.json()["session"]["reused_prefix"] == verified  # not the records the failed word counted
        if not restart:
            assert len(log.read_text().splitlines()) > len(lines)  # the cut back: written again only now
        assert not (bad_dir / "fence.json").exists()
        history = server.get(f"/v1/sessions/{BAD}?history=1").json()["history"]
        assert history == (_prompt(0) + want)[:len(history)]
        assert tok.decode(history[len(_prompt(0)):]).startswith(bad["text"])  # all it was sent is committed
        assert server.get("/healthz").json()["status"] == "ok"
        assert _metric(server.get("/metrics").text, "coli_sessions_fenced") == 0
    finally:
        server.stop()
