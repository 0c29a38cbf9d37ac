"""bench/serve.py's figures on a GLM-5.2-shaped session, against real server processes:

- ``resume_on_request_ratio``: a suspended v2 (fp8) session of GLM-5.2's cache dims; (time to the
  first token of a streamed completion on it - that request's decode step, as the server's engine
  timed it) / a raw sequential read of its kv file, per repetition, median (bench.session's
  ``raw_read``, warm page cache on both sides as bench.session's
  ``resume_ratio``). ``resume_rest_s``: that TTFT less the step and less the server's own resume
  (``coli_resume_seconds``: its opening, mapping and cache build; a request's checksum pass runs
  beside its first step, see ``resume_check_beside_s``), per repetition, median: the request's HTTP,
  IPC, admission and the commit its token waits for. The request continues the session (its prompt
  is the history, fetched before the timing; only the pending token is fed). Every timed resume is
  checked in the server's log: every committed record matched its checksum (FORMAT.md 4.4) and
  either the recomputed last position was bit-identical or within the digest's tolerance, or (the service's sessions are
  ``lazy_logits``) its recompute was deferred because the sidecar vouched for every record and
  the request fed a token, so nothing was sampled from it (FORMAT.md 5.5). ``resume_check_beside_s``:
  the checksum pass's own seconds when it ran beside the request's first step (its thread, from the
  server's log; 0 when it ran inside the resume), ``resume_check_wait_s``: how long the turn waited for
  it after that step (both medians). A pass beside shares the host's cores with the step, which is
  subtracted: on a host without an idle core part of the pass's cost is inside the step's time.
- ``http_migrate_vs_durable_copy``: the session's bundle streamed from server A
  (``GET /v1/sessions/ID/bundle``) into server B (``PUT``) through one raw-socket client
  (bench.serve_pipe: the body spliced socket to socket, B holding no copy beforehand), over the
  time of one durable copy of the session's files (``cp -r`` + fsync of each file and the
  directory): a ratio of throughputs over the same session bytes.

The served model is a checkpoint written here: bench.session_build's decoder (GLM-5.2's file dims:
78 layers, kv_lora 512, rope 64, vocab 154,880; 64-wide body, random weights).
"""
from __future__ import annotations

import json
import os
import statistics
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.serve_pipe import pipe_bundle
from bench.serve_procs import Server, stream_completion
from bench.session import raw_read
from bench.session_build import SEED, build_session, glm_cache_model
from kernels.model.config import parse_config
from kernels.model.tiny import tiny_weights
from sessionstore.sessions import Session, SessionStore

SESSION = "glm"


def write_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file of bf16 tensors (each f32 value's upper 16 bits), as real checkpoints ship."""
    header: dict[str, Any] = {}
    blobs, offset = [], 0
    for name, arr in sorted(tensors.items()):
        bits = (np.ascontiguousarray(arr, dtype="<f4").view("<u4") >> 16).astype("<u2")  # bits: [...] u16
        header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [offset, offset + bits.nbytes]}
        blobs.append(bits.tobytes())
        offset += bits.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for blob in blobs:
            f.write(blob)


def write_glm_cache_checkpoint(directory: Path) -> Path:
    """config.json + model.safetensors (bf16) of bench.session_build's GLM-5.2-shaped decoder."""
    _, cfg = glm_cache_model()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    write_bf16_safetensors(directory / "model.safetensors", tiny_weights(parse_config(cfg, source="bench"), SEED))
    return directory


def build(root: Path, model_dir: Path, n_tokens: int) -> Session:
    store = SessionStore(root)
    model, ref = store.load_model(model_dir)
    return build_session(store, model, ref, n_tokens)


def continue_prompt(server: Server) -> tuple[list[int], int]:
    """The session's history as the prompt (plus one token when nothing is pending: at least one
    token is always fed); and its committed count."""
    info = server.call("GET", f"/v1/sessions/{SESSION}?history=1")
    history: list[int] = info["history"]
    return (history if info["tokens"] > info["committed"] else [*history, 7]), int(info["committed"])


def checked_resume(server: Server, seen: int, committed: int) -> dict[str, Any]:
    """The server's resume after ``seen`` earlier ones: every record checked; the recomputed last
    position passed (bit-identical, or the digest's tolerance) or its check was deferred with
    every record vouched for (nothing sampled from it: the request feeds a token)."""
    events = server.log_events("session.resume")
    if len(events) <= seen:
        raise RuntimeError("the request did not resume the session (no session.resume in the server's log)")
    ev = events[seen]
    if not str(ev.get("checksums", "")).startswith(f"{committed} record(s) match"):
        raise RuntimeError(f"the resume did not check all {committed} records: {ev.get('checksums')!r}")
    deferred = ev.get("last_position") == "deferred" and ev.get("not_covered") == 0
    if not deferred and ev.get("verified") not in ("bit-identical", "within tolerance"):  # FORMAT.md 5.5
        raise RuntimeError(f"the resume's logits check said {ev.get('verified')!r}")
    ev["verified"] = "deferred" if deferred else ev["verified"]
    return ev


def one_token(client: httpx.Client, server: Server) -> tuple[float, int]:
    """TTFT of a streamed completion continuing the session (the pending token fed, one sampled)
    and the committed count before it."""
    prompt, committed = continue_prompt(server)
    body = {"model": server.model_id, "prompt": prompt, "max_tokens": 1, "ignore_eos": True,
            "temperature": 0, "session": SESSION}
    s = stream_completion(client, server.url, body)
    return s.first_event - s.sent, committed  # no tokenizer: the first event carries the token


STEP_SUM = 'coli_forward_seconds_sum{kind="step"}'


def bench_resume(server: Server, kv_path: Path, reps: int) -> dict[str, Any]:
    """TTFT of a request on the suspended session vs a raw read of its kv file, alternated; the
    decode step subtracted is that request's own, as the server's engine timed it
    (``coli_forward_seconds{kind="step"}``: the request feeds one token, so it runs one step and
    nothing else). Also the same request on the session while resident (what the resume adds is
    the difference). One untimed request first: the server's kernels compile on their first step."""
    ttft, resident, base, steps, resident_steps, server_resume, verified = [], [], [], [], [], [], []
    beside, waited = [], []  # the checksum pass beside the first step (its thread's seconds) and the turn's wait for it
    with httpx.Client(timeout=600) as client:
        one_token(client, server)
        server.call("POST", f"/v1/sessions/{SESSION}/suspend")
        seen = len(server.log_events("session.resume"))
        for _ in range(reps):
            resumed_before, stepped_before = server.metric("coli_resume_seconds_sum"), server.metric(STEP_SUM)
            base.append(raw_read(str(kv_path), os.path.getsize(kv_path)))
            took, committed = one_token(client, server)
            ttft.append(took)
            steps.append(server.metric(STEP_SUM) - stepped_before)
            server_resume.append(server.metric("coli_resume_seconds_sum") - resumed_before)
            event = checked_resume(server, seen, committed)
            verified.append(str(event["verified"]))
            beside.append(float(event.get("check_s", 0.0)))  # 0: the pass ran before the resume returned
            waited.append(float(event.get("check_wait_s", 0.0)))
            seen += 1
            stepped_before = server.metric(STEP_SUM)
            resident.append(one_token(client, server)[0])
            resident_steps.append(server.metric(STEP_SUM) - stepped_before)
            server.call("POST", f"/v1/sessions/{SESSION}/suspend")
    per_rep = [(t - st) / b for t, st, b in zip(ttft, steps, base, strict=True)]
    rest = [t - st - sr for t, st, sr in zip(ttft, steps, server_resume, strict=True)]  # HTTP, IPC, admit, commit
    t, b, r = statistics.median(ttft), statistics.median(base), statistics.median(resident)
    return {"resume_on_request_ratio": statistics.median(per_rep), "resume_added_ratio": (t - r) / b, "ttft_s": t,
            "ttft_resident_s": r, "raw_read_s": b, "decode_step_s": statistics.median(steps),
            "resident_step_s": statistics.median(resident_steps),
            "server_resume_s": statistics.median(server_resume), "resume_rest_s": statistics.median(rest),
            "resume_verified": verified, "resume_check_beside_s": statistics.median(beside),
            "resume_check_wait_s": statistics.median(waited),
            "kv_bytes": os.path.getsize(kv_path)}


def durable_copy(src: Path, dst: Path) -> float:
    """``cp -r`` of a directory, then fsync of every file and of the directory; seconds."""
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    for name in os.listdir(dst):
        fd = os.open(dst / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    took = time.perf_counter() - t0
    subprocess.run(["rm", "-rf", str(dst)], check=True)
    return took


def http_migrate(a: Server, b: Server, *, splice: bool = True) -> tuple[float, int, dict[str, Any]]:
    """A's bundle of the session streamed into B's PUT by one raw-socket client
    (bench.serve_pipe: A's exact Content-Length declared on the PUT, the body moved socket to
    socket with ``splice``, or through one buffer); (seconds, bundle bytes, B's answer)."""
    took, sent, answer = pipe_bundle(a.url, b.url, SESSION, splice=splice)
    result: dict[str, Any] = answer.json()
    return took, sent, result


def http_pull(a: Server, b: Server) -> tuple[float, dict[str, Any]]:
    """B pulls the session from A (``POST /v1/sessions/ID/pull``: B reads A's GET off the socket in
    its receiving thread); (seconds until B answered, B's answer)."""
    t0 = time.perf_counter()
    answer = httpx.post(f"{b.url}/v1/sessions/{SESSION}/pull", json={"from": a.url}, timeout=600)
    took = time.perf_counter() - t0
    if answer.status_code != 200:
        raise RuntimeError(f"B's pull: {answer.status_code} {answer.text[:500]}")
    result: dict[str, Any] = answer.json()
    return took, result


def bench_migrate(a: Server, b: Server, session_dir: Path, scratch: Path, reps: int) -> dict[str, Any]:
    """HTTP migration A -> B vs one durable copy of the session's files, alternated: B pulling
    from A (B started with ``--pull-from`` A), and a client piping A's GET into B's PUT. Each
    writes into a place that holds no copy yet: B's copy of the session is deleted before each
    move and the durable copy is removed after each copy, all untimed."""
    want = a.call("GET", f"/v1/sessions/{SESSION}")["committed"]
    files = sum(os.path.getsize(session_dir / n) for n in os.listdir(session_dir))
    ours, piped, base, wire = [], [], [], 0

    def fresh_b() -> None:
        if httpx.get(f"{b.url}/v1/sessions/{SESSION}", timeout=60).status_code == 200:
            b.call("DELETE", f"/v1/sessions/{SESSION}")

    def check(answer: dict[str, Any], how: str) -> None:
        if answer.get("committed") != want:
            raise RuntimeError(f"B holds {answer.get('committed')} committed tokens after the {how}, A {want}")

    for _ in range(reps):
        base.append(durable_copy(session_dir, scratch / "copy"))
        fresh_b()
        took, answer = http_pull(a, b)
        check(answer, "pull")
        ours.append(took)
        fresh_b()
        took, wire, answer = http_migrate(a, b)
        check(answer, "pipe")
        piped.append(took)
    t, p, c = statistics.median(ours), statistics.median(piped), statistics.median(base)
    return {"http_migrate_vs_durable_copy": c / t, "http_migrate_s": t, "durable_copy_s": c,
            "http_migrate_pipe_vs_durable_copy": c / p, "http_migrate_pipe_s": p,
            "session_bytes": files, "bundle_bytes": wire, "http_migrate_gb_s": files / t / 1e9,
            "durable_copy_gb_s": files / c / 1e9, "http_migrate_all_s": ours, "http_migrate_pipe_all_s": piped,
            "durable_copy_all_s": base}


__all__ = ["SESSION", "bench_migrate", "bench_resume", "build", "durable_copy",
           "http_migrate", "http_pull", "write_glm_cache_checkpoint"]
