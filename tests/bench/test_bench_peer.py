"""bench.peer's client and keys against a fake server speaking both servers' SSE shapes (ours: a
final chunk with ``token_ids``; llama.cpp: a final chunk with ``usage``, and its own ``/completion``
chunks with ``tokens``). No llama.cpp build: the bench itself is not a test."""
from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.peer import main as peer_main
from bench.peer import table as peer_table
from bench.peer_client import Late, PeerError, parse_reply, stream_many, stream_one
from bench.peer_measure import RATIO_KEYS, first_difference, greedy_keys, measure, ratio_keys, stall_ratio
from bench.peer_multiturn import aiperf_command, medians, multiturn, multiturn_keys, read_metrics
from bench.peer_servers import Side

TOKEN_S = 0.001  # the fake's time per token


class Fake(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` (or ``n_predict``) tokens, token i being ``prompt[0] + i``; a prompt
    longer than 100 tokens holds every other stream for 30 ms (the stall a long prefill causes)."""

    protocol_version = "HTTP/1.0"
    shape = "ours"
    busy = threading.Lock()

    def log_message(self, *args: Any) -> None:
        pass

    def send(self, obj: Any) -> None:
        self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
        self.wfile.flush()

    def do_POST(self) -> None:  # http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("fail"):
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "bad"}}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        prompt, n = body["prompt"], body.get("max_tokens", body.get("n_predict"))
        if len(prompt) > 100:
            with self.busy:
                time.sleep(0.03)
        ids = [prompt[0] + i for i in range(n)]
        for t in ids:
            with self.busy:
                pass
            time.sleep(TOKEN_S)
            if self.path == "/completion":
                self.send({"content": "x", "tokens": [t], "stop": False})
            else:
                self.send({"choices": [{"index": 0, "text": "x", "finish_reason": None}]})
        if self.path == "/completion":
            self.send({"content": "", "tokens": [], "stop": True, "tokens_predicted": n})
            return
        last: dict[str, Any] = {"index": 0, "text": "", "finish_reason": "length"}
        if self.shape == "ours":
            self.send({"choices": [{**last, "token_ids": ids}]})
        else:
            self.send({"choices": [last], "usage": {"completion_tokens": n}})
        self.send(b"[DONE]")


@pytest.fixture(params=["ours", "llama.cpp"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    handler = type("Shaped", (Fake,), {"shape": request.param})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class FakeSide(Side):
    name = "fake"

    def __init__(self, url: str) -> None:
        self.url, self.resumed = url, 0

    def suspend(self, key: str, prompt: list[int]) -> None:
        stream_one(self.url, self.body(prompt, 1))

    def resume(self, key: str, prompt: list[int]) -> float:
        self.resumed += 1
        return stream_one(self.url, self.body([*prompt, 100], 1)).ttft


def test_one_stream_both_shapes(url: str) -> None:
    reply = stream_one(url, {"prompt": [40, 41], "max_tokens": 5})
    assert reply.n_tokens == 5 and len(reply.token_times) == 5
    assert reply.sent < reply.token_times[0] <= reply.token_times[-1] <= reply.done
    assert 0 < reply.ttft < 1 and 5 / (reply.done - reply.sent) == pytest.approx(reply.tok_s)
    assert reply.token_ids == ([40, 41, 42, 43, 44] if "ours" in url or reply.token_ids else [])


def test_native_completion_carries_token_ids(url: str) -> None:
    reply = stream_one(url, {"prompt": [7], "n_predict": 4}, path="/completion")
    assert reply.token_ids == [7, 8, 9, 10] and reply.n_tokens == 4


def test_many_at_once_and_a_late_admission(url: str) -> None:
    bodies = [{"prompt": [10 * i], "max_tokens": 30} for i in range(4)]
    *running, admitted = stream_many(url, bodies, late=Late({"prompt": list(range(200)), "max_tokens": 1}, after=5))
    assert [r.n_tokens for r in running] == [30] * 4 and admitted.n_tokens == 1
    assert admitted.sent > running[0].token_times[4]  # sent once stream 0 had 5 tokens
    assert stall_ratio(running, admitted) > 3  # the fake's 30 ms hold over ~1 ms gaps


def test_error_status_and_broken_stream(url: str) -> None:
    with pytest.raises(PeerError, match="HTTP 400"):
        stream_one(url, {"prompt": [1], "max_tokens": 1, "fail": True})
    with pytest.raises(PeerError, match="without a final event"):
        parse_reply(0.0, [(1.0, b'data: {"choices": [{"text": "a", "finish_reason": null}]}')])
    with pytest.raises(PeerError, match="mid-stream"):
        parse_reply(0.0, [(1.0, b'data: {"error": {"message": "boom"}}')])


def test_measure_and_keys(url: str) -> None:
    side = FakeSide(url)
    reps = [measure(side, 0, stall_reps=1, tokens=24)]
    assert side.resumed == 1
    for rep in reps:
        assert set(rep) == set(RATIO_KEYS.values())
        assert rep["ttft1_s"] < rep["prefill_s"]  # the long prompt's 30 ms hold
        assert rep["agg16_tok_s"] > rep["solo_tok_s"]  # 16 fake streams overlap
    slower = [{k: v * (0.5 if k.endswith("tok_s") else 2.0) for k, v in rep.items()} for rep in reps]
    keys = ratio_keys(slower, reps)
    for key, raw in RATIO_KEYS.items():
        assert keys[key] == pytest.approx(0.5 if raw.endswith("tok_s") else 2.0), key
    assert keys["ours"]["solo_tok_s"] == pytest.approx(keys["llama_cpp"]["solo_tok_s"] / 2)


def test_greedy_keys() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    keys = greedy_keys([[1], [2, 3]], [[5, 6], [7, 8]], [[5, 6], [7, 9]])
    assert keys["peer_greedy_equal"] == 1 and keys["peer_greedy_first_difference"] == [None, 1]
    assert keys["peer_greedy_prompt_lengths"] == [1, 2]
    assert keys["peer_greedy_first_difference_position"] == [None, 3]


def test_aiperf_export_and_multiturn_keys(tmp_path: Path) -> None:
    def export(tok_s: float, ttft: float, itl: float) -> Path:
        path = tmp_path / f"{tok_s}.json"
        path.write_text(json.dumps({"output_token_throughput": {"unit": "tokens/sec", "avg": tok_s},
                                    "time_to_first_token": {"unit": "ms", "avg": ttft, "p50": 1.0},
                                    "inter_token_latency": {"unit": "ms", "avg": itl},
                                    "request_count": {"avg": 64.0},
                                    "error_summary": [{"count": 2, "error_details": {"code": 500}}]}))
        return path

    ours, theirs = read_metrics(export(300.0, 50.0, 8.0)), read_metrics(export(100.0, 200.0, 16.0))
    assert ours == {"tok_s": 300.0, "ttft_ms": 50.0, "itl_ms": 8.0, "errors": 2.0, "requests": 64.0}
    keys = multiturn_keys(ours, theirs)
    assert (keys["peer_multiturn_tok_s_ratio"], keys["peer_multiturn_ttft_ratio"],
            keys["peer_multiturn_itl_ratio"]) == (3.0, 0.25, 0.5)
    cmd = aiperf_command("aiperf", "http://h:1", "m", tmp_path, tmp_path / "out")
    assert cmd[cmd.index("--session-header") + 1] == "X-Session-Id"
    assert cmd[cmd.index("--conversation-num") + 1] == "16" and cmd[cmd.index("--concurrency") + 1] == "16"


def test_multiturn_alternates_warms_each_side_and_takes_medians(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake aiperf (its figures by the server's URL and the run's order): the sides alternate which
    goes first, each is warmed before it is timed and stopped after, the keys are the medians."""
    fake = tmp_path / "aiperf"
    fake.write_text(f"""#!{sys.executable}
import json, pathlib, sys
a = sys.argv
out = pathlib.Path(a[a.index("--artifact-dir") + 1]); out.mkdir(parents=True)
log = pathlib.Path({str(tmp_path / "order")!r}); runs = log.read_text().split() if log.exists() else []
url = a[a.index("--url") + 1]; log.write_text(" ".join([*runs, url]))
tok_s = (100.0 if "ours" in url else 50.0) + len(runs)
(out / "profile_export_aiperf.json").write_text(json.dumps({{
    "output_token_throughput": {{"avg": tok_s}}, "time_to_first_token": {{"avg": 10.0}},
    "inter_token_latency": {{"avg": 2.0}}, "request_count": {{"avg": 64.0}}}}))
""")
    fake.chmod(0o755)
    monkeypatch.setenv("COLI_AIPERF", str(fake))
    events: list[str] = []

    def side(name: str) -> Any:
        events.append(f"start {name}")
        return SimpleNamespace(name=name, url=f"http://{name}", model_name="m", stop=lambda: events.append("stop"))

    start = {"ours": lambda: side("ours"), "llama.cpp": lambda: side("llama")}
    res = multiturn(start, tmp_path, tmp_path / "scratch", reps=3, warm=lambda s: events.append(f"warm {s.name}"))
    assert (tmp_path / "order").read_text().split() == ["http://ours", "http://llama", "http://llama", "http://ours",
                                                       "http://ours", "http://llama"]
    assert events[:3] == ["start ours", "warm ours", "stop"] and events.count("stop") == 6
    assert res["multiturn"]["ours"]["tok_s"] == 103.0  # of 100, 103, 104
    assert res["multiturn"]["llama_cpp"]["tok_s"] == 52.0  # of 51, 52, 55
    assert res["multiturn"]["ours"]["requests"] == 192.0  # summed over the reps
    assert res["peer_multiturn_tok_s_ratio"] == 103.0 / 52.0 and len(res["multiturn"]["reps"]["ours"]) == 3
    assert medians([{"tok_s": 1.0, "errors": 1.0}, {"tok_s": 3.0, "errors": 0.0}]) == {"tok_s": 2.0, "errors": 1.0}


def test_no_build_tools_is_one_line_and_a_nonzero_exit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no cmake, no compiler, no git
    assert peer_main(["--json", "--cache", str(tmp_path / "cache")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no cmake on PATH" in err and "Traceback" not in err


def test_table_shows_every_key() -> None:
    raw = {name: 2.0 for name in RATIO_KEYS.values()}
    res = {**ratio_keys([raw], [{k: v / 2 for k, v in raw.items()}]), **greedy_keys([[1]], [[2]], [[2]]),
           "peer_greedy_equal_same_tie_rule": 7, "peer_greedy_first_difference_same_tie_rule": [3],
           **multiturn_keys({"tok_s": 3.0, "ttft_ms": 1.0, "itl_ms": 1.0},
                            {"tok_s": 1.0, "ttft_ms": 4.0, "itl_ms": 2.0})}
    text = peer_table(res)
    assert sum(line.endswith("| 2.00 |") for line in text.splitlines()) == len(RATIO_KEYS) and "1 of 1" in text
    assert "tie rule (in process) | | | 7 of 1 (first differences [3])" in text
    assert "| 3.0 | 1.0 | 3.00 |" in text and "| 1.0 | 4.0 | 0.25 |" in text and "| 1.0 | 2.0 | 0.50 |" in text


def test_a_retrained_checkpoint_gets_a_gguf_of_its_own(tmp_path: Path) -> None:
    """The converted gguf is cached under the checkpoint's digest: new weights (or config) are converted
    again, never served from the old weights' gguf (session 19 retrained glm-mini and bench.peer went on
    comparing against the old weights); the tokenizer's files do not count."""
    from bench.peer_build import checkpoint_digest

    model = tmp_path / "glm-mini"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"weights-1")
    (model / "tokenizer.json").write_text("{}")
    first = checkpoint_digest(model)
    (model / "tokenizer.json").write_text('{"changed": true}')
    assert checkpoint_digest(model) == first
    (model / "model.safetensors").write_bytes(b"weights-2")
    second = checkpoint_digest(model)
    (model / "config.json").write_text('{"hidden_size": 65}')
    assert len({first, second, checkpoint_digest(model)}) == 3
