"""Write-through shipping through real servers (``serve --http --remote``) on a real S3 server
(SeaweedFS): host A runs turns of two sessions, each turn shipped as a segment before its answer; the
whole host A (API process and engine core) is SIGKILLed in the middle of a stream; once A's lease
expires host B continues every session from its last shipped turn, token-exact against one
uninterrupted run, by fetching the chain (its prompts reuse every committed token: no re-prefill)."""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessionstore.migration import RemoteStore
from sessionstore.migration.segment_format import CUT_SEGMENT_VERSION, parse_segment
from sessionstore.migration.shipping import TurnShipper
from sessionstore.sessions import SessionStore
from tests.service.test_service_fleet import Conversation, fleet_url, host  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(240)

LEASE_TTL_S = 3.0


def kill_host(server: Any) -> None:
    """SIGKILL the engine core and the API process: nothing of host A runs its shutdown."""
    pid = server.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        try:
            import os

            os.kill(int(child), signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.stop(signal.SIGKILL)


def test_host_sigkill_mid_stream_then_takeover_from_segments_is_token_exact(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any], fleet_url: str) -> None:
    model, _ = text_model
    a = host(tmp_path, "host-a", text_model_dir, fleet_url, "--lease-ttl", str(LEASE_TTL_S)).start()
    try:
        model_id = a.get("/v1/models").json()["data"][0]["id"]
        convs = [Conversation(model_id, "one"), Conversation(model_id, "two")]
        got: dict[str, list[list[int]]] = {c.sid: [] for c in convs}
        for new in ([9, 8, 7], [6, 5]):
            for conv in convs:
                got[conv.sid].append(conv.turn(a, new, 6))
        reader = TurnShipper(RemoteStore(SessionStore(tmp_path / "reader"), fleet_url, host_id="reader"))
        for conv in convs:  # shipped before each answer: the head covers every committed record
            head = reader.read_head(conv.sid)
            assert head is not None and head.owner == "host-a" and head.count >= 1
            assert head.nrec == len(conv.history) - 1
        # long (ignore_eos): on a loaded machine this reader can lag the stream by a second; the reply must
        # still be running when the kill lands, or A ships its end and B's copy holds the cut turn
        body = {**convs[0].body([4, 3], 4000), "stream": True}
        with httpx.stream("POST", a.url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # the first tokens are out: the turn is mid-stream
            kill_host(a)
    finally:
        if a.proc is not None and a.proc.poll() is None:
            a.stop(signal.SIGKILL)

    with host(tmp_path, "host-b", text_model_dir, fleet_url) as b:
        t0 = time.monotonic()
        leases = [reader.remote.lease(conv.sid) for conv in convs]
        assert all(lease is not None and lease.owner == "host-a" and not lease.released for lease in leases)
        time.sleep(max(0.0, max(lease.expires_at for lease in leases if lease) - time.time()))
        for conv in convs:  # asserts reused_prefix == everything A had shipped: fetched, not re-run
            got[conv.sid].append(conv.turn(b, [2, 1], 7))
        takeover_s = time.monotonic() - t0
        for conv in convs:
            assert got[conv.sid] == conv.reference(model)
        assert takeover_s < LEASE_TTL_S + 60
        head = reader.read_head("one")
        assert head is not None and head.owner == "host-b" and head.nrec == len(convs[0].history) - 1


def test_ship_every_commit_ships_inside_a_reply(tmp_path: Path, text_model_dir: Path,
                                                text_model: tuple[Any, Any], fleet_url: str) -> None:
    """``--ship-every-commit``: a host killed mid-reply has shipped the reply's commits so far (every
    ``--commit-every`` tokens), each a prefix of the uninterrupted reply, installable elsewhere."""
    model, _ = text_model
    a = host(tmp_path, "host-a", text_model_dir, fleet_url, "--lease-ttl", str(LEASE_TTL_S),
             "--ship-every-commit", "--commit-every", "4").start()
    reader = TurnShipper(RemoteStore(SessionStore(tmp_path / "reader"), fleet_url, host_id="reader",
                                     lease_ttl=LEASE_TTL_S))
    try:
        conv = Conversation(a.get("/v1/models").json()["data"][0]["id"], "one")
        conv.turn(a, [9, 8, 7], 5)
        before = len(conv.history) - 1
        body = {**conv.body([4, 3], 600), "stream": True}
        seen = 0
        with httpx.stream("POST", a.url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                seen += line.startswith("data: {")
                head = reader.read_head("one")
                if seen >= 12 and head is not None and head.nrec > before + 2:
                    break  # commits inside the reply are in the store while it streams
            kill_host(a)
    finally:
        if a.proc is not None and a.proc.poll() is None:
            a.stop(signal.SIGKILL)
    head = reader.read_head("one")
    assert head is not None and before + 2 < head.nrec < before + 2 + 600  # mid-reply, not its end
    conv.turns.append((body["prompt"], 600))
    full = body["prompt"] + conv.reference(model)[-1]  # the uninterrupted reply
    lease = reader.remote.lease("one")
    assert lease is not None
    time.sleep(max(0.0, lease.expires_at - time.time()))
    taken = reader.remote.acquire("one")
    assert reader.take_over("one", taken, local_current=False)
    store = reader.remote.store
    assert store.read_manifest("one").committed == head.nrec
    from sessionstore.kvfile import open_kv

    with open_kv(store.kv_path("one")) as kv:
        assert [int(t) for t in kv.tokens[:head.nrec]] == full[:head.nrec]


def test_a_cut_turn_ships_a_cut_segment_and_a_takeover_continues_it_token_exact(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any], fleet_url: str) -> None:
    """A completions turn whose prompt replaces the previous reply's last tokens (a re-tokenized
    boundary, issue 38 part 2) ships a version-2 cut segment onto the same base, no new bundle;
    host A is SIGKILLed and host B continues from the chain, token-exact."""
    model, _ = text_model
    a = host(tmp_path, "host-a", text_model_dir, fleet_url, "--lease-ttl", str(LEASE_TTL_S)).start()
    reader = TurnShipper(RemoteStore(SessionStore(tmp_path / "reader"), fleet_url, host_id="reader"))
    try:
        conv = Conversation(a.get("/v1/models").json()["data"][0]["id"], "one")
        got = [conv.turn(a, [9, 8, 7], 8), conv.turn(a, [6, 5], 8)]
        before = reader.read_head("one")
        assert before is not None and before.count >= 1
        kept = len(conv.history) - 4  # the reply's last tokens come back re-tokenized
        prompt = conv.history[:kept] + [t + 1 if t + 1 != conv.history[kept] else t + 2 for t in (3, 3)]
        body = {**conv.body([], 6), "prompt": prompt}
        response = a.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["session"]["reused_prefix"] == kept
        got.append(response.json()["choices"][0]["token_ids"])
        conv.turns.append((prompt, 6))
        conv.history = prompt + got[-1]
        head = reader.read_head("one")
        assert head is not None and head.nrec == len(conv.history) - 1 and head.base == before.base
        assert head.last is not None and head.last.start == kept < before.nrec  # a cut, from the reuse point
        key = reader.segment_key("one", head.last.name)
        data = reader.remote.fs.cat_file(f"{reader.remote.bucket}/{key}")
        assert parse_segment(data, key, session_id="one", digest=head.last.digest).version == CUT_SEGMENT_VERSION
        kill_host(a)
    finally:
        if a.proc is not None and a.proc.poll() is None:
            a.stop(signal.SIGKILL)
    with host(tmp_path, "host-b", text_model_dir, fleet_url) as b:
        lease = reader.remote.lease("one")
        assert lease is not None
        time.sleep(max(0.0, lease.expires_at - time.time()))
        got.append(conv.turn(b, [2, 1], 5))  # asserts every committed record was fetched, not re-run
    assert got == conv.reference(model)
