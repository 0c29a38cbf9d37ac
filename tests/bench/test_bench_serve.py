"""bench/serve.py: its stream accounting on hand-made timelines, the lean client's parsing of a
chunked event stream cut anywhere, and its quick mode end to end on the smallest sizes (real
server processes), printing every key."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve_decode import aggregate_rate, decode_span
from bench.serve_procs import Streamed
from bench.serve_sse import SseStream

REPO = Path(__file__).resolve().parents[2]


def stream(times: list[float], n_tokens: int | None = None) -> Streamed:
    s = Streamed(sent=0.0, text_times=list(times), first_event=times[0], done=times[-1])
    s.final = {"choices": [{"token_ids": list(range(len(times) if n_tokens is None else n_tokens))}]}
    return s


def test_decode_span_excludes_the_prefill_and_refuses_merged_events():
    s = stream([5.0, 5.5, 6.0, 6.5])  # the first token after a 5 s prefill
    assert decode_span(s) == (3, 1.5)
    with pytest.raises(RuntimeError, match="one per token"):
        decode_span(stream([5.0, 5.5, 6.0], n_tokens=4))


def test_aggregate_counts_only_the_window_where_every_stream_decodes():
    a = stream([0.0, 1.0, 2.0, 3.0, 4.0])
    b = stream([1.5, 2.5, 3.5, 4.5])  # starts later: the window is (1.5, 4.0]
    rate, window, n = aggregate_rate([a, b])
    assert (window, n) == (2.5, 3 + 2)  # a: 2, 3, 4; b: 2.5, 3.5
    assert rate == pytest.approx(5 / 2.5)


def _chunked(events: list[bytes]) -> bytes:
    body = b"".join(b"data: " + e + b"\n\n" for e in events)
    framed = b"".join(b"%x\r\n" % len(body[i:i + 7]) + body[i:i + 7] + b"\r\n" for i in range(0, len(body), 7))
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n"


@pytest.mark.parametrize("piece", [1, 5, 64, 10_000])
def test_the_lean_client_times_each_event_when_its_last_byte_arrives(piece: int) -> None:
    text = [json.dumps({"choices": [{"text": t, "finish_reason": None}]}).encode() for t in ("a", "b", "c")]
    final = json.dumps({"choices": [{"text": "", "finish_reason": "length", "token_ids": [1, 2, 3]}]}).encode()
    raw = _chunked([*text, final, b"[DONE]"])
    s = SseStream(sock=None)  # type: ignore[arg-type]  # feed() never touches the socket
    for i in range(0, len(raw), piece):
        s.feed(raw[i:i + piece], now=float(i))
    got = s.streamed()
    assert s.ended and got.tokens == [1, 2, 3] and len(got.text_times) == 3
    if piece > len(raw):  # one piece: every event arrived with it
        assert got.text_times == [0.0, 0.0, 0.0]
    else:  # each event timed by the piece that completed it: later events, later pieces
        assert got.text_times == sorted(got.text_times) and got.text_times[-1] < got.done
        assert piece > 5 or len(set(got.text_times)) == 3


def test_aggregate_of_streams_that_never_overlap_uses_the_whole_span():
    rate, window, n = aggregate_rate([stream([0.0, 1.0, 2.0]), stream([3.0, 4.0])])
    assert (window, n) == (4.0, 2 + 1)
    assert rate == pytest.approx(3 / 4.0)


@pytest.mark.timeout(600)
def test_serve_bench_quick_smallest_path_reports_every_figure(tmp_path):
    pytest.importorskip("uvicorn", reason="the service extra (starlette, uvicorn) runs the servers")
    pytest.importorskip("tokenizers", reason="the text extra reads glm-mini's tokenizer")
    out = subprocess.run([sys.executable, "-m", "bench.serve", "--quick", "--json", "--tokens", "256", "--reps", "1",
                          "--max-tokens", "4", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("batch16_speedup", "batch16_speedup_httpx", "batch16_step_speedup", "stream_overhead_ratio",
                "served_over_step16", "ttft16_over_ttft1", "itl_max_during_long_prefill_over_median",
                "long_prefill_ttft_s", "ttft1_s", "ttft16_s",
                "http_migrate_vs_durable_copy", "ttft_s", "ttft_resident_s",
                "raw_read_s", "decode_step_s", "in_process_step_s", "durable_copy_s"):
        assert res[key] > 0, key
    assert res["batch16_share_of_step_speedup"] > 0 and "batch16_outside_step_s" in res
    assert "stream_overhead_s" in res and "outside the step" in out.stdout
    # TTFT - one step: a few ms at 256 tokens, inside the step's noise on a loaded machine (either sign)
    assert math.isfinite(res["resume_on_request_ratio"]) and math.isfinite(res["resume_added_ratio"])
    assert math.isfinite(res["resume_rest_s"]) and "the rest (HTTP, IPC, admission, the commit)" in out.stdout
    assert res["quick"] is True and res["tokens"] == 256
    assert res["resume_verified"] and set(res["resume_verified"]) <= {"bit-identical", "within tolerance", "deferred"}
    assert res["bundle_bytes"] > 0.8 * 256 * 45_556  # every record went over the wire (v2 records of 45,556 B)
    assert "GLM-5.2's cache dims" in res["model_note"]
    assert "goal <= 1.5" in out.stdout and "goal >= 0.8" in out.stdout
    assert not list(tmp_path.iterdir())  # the stores are removed
