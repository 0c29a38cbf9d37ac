"""``GET /metrics`` over a real server: the series' names and types as Prometheus reads them (time to
first token and inter-token latency histograms with buckets for long turns, prompt / cached /
generated token counters exposed with ``_total``, requests waiting and running gauges, decode steps
as a counter), and their values against the usage the turns reported."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sessionstore.kvfile import HEADER_SIZE, open_kv
from tests.service.serverkit import ServerProc, sse_events

TYPES = {"coli_time_to_first_token_seconds": "histogram", "coli_inter_token_latency_seconds": "histogram",
         "coli_turn_seconds": "histogram", "coli_prompt_tokens": "counter", "coli_cached_prompt_tokens": "counter",
         "coli_tokens_generated": "counter", "coli_decode_steps": "counter", "coli_requests_waiting": "gauge",
         "coli_requests_running": "gauge", "coli_requests": "counter", "coli_commits_in_flight": "gauge",
         "coli_records_refused": "counter", "coli_prompt_tokens_served": "counter"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, text_model_dir: Path) -> Any:
    with ServerProc(tmp_path_factory.mktemp("metrics") / "root", text_model_dir) as proc:
        yield proc


def _scrape(server: ServerProc) -> dict[str, Any]:
    """Family name -> family, as the Prometheus text parser reads the page."""
    return {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}


def _value(families: dict[str, Any], sample: str, **labels: str) -> float:
    for family in families.values():
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {sample} {labels}")


def test_names_types_and_buckets(server: ServerProc) -> None:
    families = _scrape(server)
    for name, kind in TYPES.items():
        assert families[name].type == kind, name
    text = server.get("/metrics").text
    for exposed in ("coli_decode_steps_total ", "coli_prompt_tokens_total ", "coli_cached_prompt_tokens_total ",
                    "coli_tokens_generated_total ", "coli_records_refused_total ",
                    'coli_prompt_tokens_served_total{source="stored_kv"} ',
                    'coli_prompt_tokens_served_total{source="computed"} '):
        assert exposed in text, exposed
    assert "\ncoli_decode_steps " not in text  # a counter now, not a gauge without _total
    assert 'coli_time_to_first_token_seconds_bucket{le="600.0"}' in text
    assert 'coli_turn_seconds_bucket{le="3600.0"}' in text
    assert 'coli_inter_token_latency_seconds_bucket{le="30.0"}' in text


def test_running_while_a_turn_streams_then_not(server: ServerProc) -> None:
    body = {"model": Path(server.model).name, "prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        events = sse_events(response)  # kept: a dropped generator would close the response
        next(events)  # running: its first token came
        families = _scrape(server)
        assert _value(families, "coli_requests_running") == 1 and _value(families, "coli_requests_waiting") == 0
    deadline = time.monotonic() + 60  # the client is gone: the turn ends at its next token
    while _value(_scrape(server), "coli_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    families = _scrape(server)
    assert _value(families, "coli_requests_running") == 0 and _value(families, "coli_requests_waiting") == 0
    assert _value(families, "coli_commits_in_flight") == 0  # the turn's last commit was waited for


def test_values_follow_the_turns_usage(server: ServerProc) -> None:
    client, name = server.openai(), Path(server.model).name
    before = _scrape(server)
    usages, generated = [], []
    msgs = [{"role": "user", "content": "Hello there, how are you today?"}]
    for turn in range(2):
        reply = client.chat.completions.create(model=name, messages=msgs, max_tokens=8, extra_body={
            "session": "counted", "ignore_eos": True})
        usages.append(reply.usage)
        generated.append(len(reply.choices[0].token_ids))
        msgs = [*msgs, {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"And {turn}?"}]
    stream = client.chat.completions.create(model=name, messages=msgs, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"session": "counted", "ignore_eos": True})
    chunks = list(stream)
    usages.append(chunks[-1].usage)
    generated.append(chunks[-1].usage.completion_tokens)
    after = _scrape(server)

    def delta(sample: str) -> float:
        return _value(after, sample) - _value(before, sample)

    assert delta("coli_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert cached > 0 and delta("coli_cached_prompt_tokens_total") == cached
    # the engine's count of the same prompts: served from the session's stored KV, or computed
    series = "coli_prompt_tokens_served_total"
    served = {source: _value(after, series, source=source) - _value(before, series, source=source)
              for source in ("stored_kv", "computed")}
    assert served == {"stored_kv": cached, "computed": sum(u.prompt_tokens for u in usages) - cached}
    assert delta("coli_tokens_generated_total") == sum(generated) == 8 + 8 + 6
    assert delta("coli_time_to_first_token_seconds_count") == 3
    assert 1 <= delta("coli_inter_token_latency_seconds_count") <= sum(g - 1 for g in generated)
    assert delta("coli_decode_steps_total") >= max(generated) - 1


def test_records_refused_by_their_checksums_are_counted(server: ServerProc) -> None:
    """A suspended session whose kv file lost a bit in a committed record: its resume is refused by
    the sidecar's checksums (an error, nothing served from the record) and the record is counted."""
    name = Path(server.model).name
    done = server.post("/v1/completions", json={"model": name, "prompt": list(range(5, 25)), "max_tokens": 4,
                                                "session": "damaged", "ignore_eos": True})
    assert done.status_code == 200, done.text
    assert server.post("/v1/sessions/damaged/suspend").status_code == 200
    kv = Path(server.root) / "sessions" / "damaged" / "kv.coli_kv"
    reader = open_kv(kv)
    record, count = reader.record_bytes, reader.nrec
    reader.close()
    assert count > 3
    with open(kv, "r+b") as f:  # one bit of record 2's rows
        f.seek(HEADER_SIZE + 2 * record + 8)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    before = _value(_scrape(server), "coli_records_refused_total")
    again = server.post("/v1/completions", json={"model": name, "prompt": [5, 6], "max_tokens": 2,
                                                 "session": "damaged"})
    assert again.status_code >= 400 and "checksum" in again.json()["error"]["message"], again.text
    assert _value(_scrape(server), "coli_records_refused_total") - before == 1
