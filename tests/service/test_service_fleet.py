"""Servers as hosts of one fleet (``serve --http --remote s3://...``) on a real S3 server
(SeaweedFS, the run's one: tests/conftest.py) on loopback: alternating turns of one conversation on
two servers are token-exact against one
uninterrupted run (the session leased and pulled before each turn, pushed back on suspend,
eviction and shutdown); a request while another server holds the session live is 409 naming it;
a lost lease (the store cut past the TTL, the session taken over) is 503 / 409 at the next turn
and never pushed over the new owner's bundle; the sessions list shows the fleet's sessions."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kernels.model.sampling import Sampler
from sessionstore.migration import RemoteStore
from sessionstore.sessions import SessionStore, reference_turns
from tests.service.serverkit import ServerProc
from tests.support.migrate import stored_keys
from tests.support.s3_relay import Relay
from tests.support.seaweed import Bucket

pytestmark = pytest.mark.timeout(240)

SAMPLING = {"temperature": 0.9, "top_k": 40, "seed": 11}  # every turn's own (the API never inherits a sampler)


@pytest.fixture
def fleet_url(s3_bucket: Bucket) -> str:
    """The fleet's prefix in this test's own bucket on SeaweedFS (the AWS environment names it)."""
    return s3_bucket.url("fleet")


def host(tmp_path: Path, name: str, model: Path, url: str, *args: str, env: dict[str, str] | None = None) -> ServerProc:
    return ServerProc(tmp_path / name, model, "--remote", url, "--host-id", name, *args,
                      log_dir=tmp_path, env=env)


class Conversation:
    """One conversation in completions turns: each prompt is the whole history plus new ids."""

    def __init__(self, model_id: str, sid: str) -> None:
        self.model_id, self.sid = model_id, sid
        self.history: list[int] = []
        self.turns: list[tuple[list[int], int]] = []

    def body(self, new: list[int], max_tokens: int) -> dict[str, Any]:
        prompt = self.history + new
        return {"model": self.model_id, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "session": self.sid, **SAMPLING}

    def turn(self, server: ServerProc, new: list[int], max_tokens: int) -> list[int]:
        body = self.body(new, max_tokens)
        response = server.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        tokens: list[int] = response.json()["choices"][0]["token_ids"]
        # the copy served is the fleet's latest: all it had committed (all but the pending id) reused
        assert response.json()["session"]["reused_prefix"] == max(len(self.history) - 1, 0)
        self.turns.append((body["prompt"], max_tokens))
        self.history = body["prompt"] + tokens
        return tokens

    def refused(self, server: ServerProc, new: list[int], status: int, code: str) -> str:
        response = server.post("/v1/completions", json=self.body(new, 4))
        assert response.status_code == status, response.text
        err = response.json()["error"]
        assert err["code"] == code, err
        return str(err["message"])

    def reference(self, model: Any) -> list[list[int]]:
        sampler = Sampler.checked(SAMPLING["temperature"], SAMPLING["top_k"], 1.0, SAMPLING["seed"])
        return reference_turns(model, "fp8", self.turns, sampler)


def listed(server: ServerProc) -> dict[str, dict[str, Any]]:
    response = server.get("/v1/sessions")
    assert response.status_code == 200, response.text
    return {d["id"]: d for d in response.json()["data"]}


def test_two_servers_alternate_turns_token_exact(tmp_path: Path, text_model_dir: Path,
                                                 text_model: tuple[Any, Any], fleet_url: str) -> None:
    model, _ = text_model
    with host(tmp_path, "host-a", text_model_dir, fleet_url) as a, \
            host(tmp_path, "host-b", text_model_dir, fleet_url, "--max-resident", "1") as b:
        conv = Conversation(a.get("/v1/models").json()["data"][0]["id"], "conv")
        got = [conv.turn(a, [9, 8, 7, 6], 10)]
        message = conv.refused(b, [5], 409, "session_held")  # A holds it live
        assert "held live by host 'host-a'" in message
        seen = listed(b)["conv"]
        assert seen["state"] == "remote" and seen["fleet"]["holder"] == "host-a"
        assert a.post("/v1/sessions/conv/suspend").status_code == 200  # pushed, released
        assert listed(a)["conv"]["fleet"]["held"] is False

        got.append(conv.turn(b, [5, 4], 8))  # pulled on B
        assert listed(a)["conv"]["state"] == "remote"  # A's copy is stale now, B holds it
        assert conv.refused(a, [3], 409, "session_held").count("'host-b'") == 1
        other = conv.model_id
        evict = b.post("/v1/completions", json={"model": other, "prompt": [1, 2], "max_tokens": 2,
                                                 "session": "other"})
        assert evict.status_code == 200, evict.text  # max_resident 1: conv is evicted, pushed back

        got.append(conv.turn(a, [3, 2], 9))  # A pulls B's newer bundle over its own copy
        assert a.stop() == 0  # shutdown pushes conv back
        got.append(conv.turn(b, [1], 7))  # B's copy is stale: pulled again
        assert got == conv.reference(model)
        assert b.stop() == 0

    remote = RemoteStore(SessionStore(tmp_path / "reader"), fleet_url, host_id="reader")
    leases = {lease.session_id: lease for lease in remote.list()}
    assert set(leases) == {"conv", "other"} and all(lease.released for lease in leases.values())
    assert leases["conv"].owner == "host-b" and leases["conv"].bundle_tokens == len(conv.history) - 1
    assert stored_keys(remote, "bundles", "conv") == [leases["conv"].bundle]


def test_a_lost_lease_is_refused_at_the_next_turn_and_never_pushed_over(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any], fleet_url: str,
        s3_bucket: Bucket) -> None:
    model, _ = text_model
    relay = Relay(("127.0.0.1", int(s3_bucket.endpoint.rsplit(":", 1)[1])))  # the real store, cut at will
    through = {"AWS_ENDPOINT_URL": relay.url, "AWS_MAX_ATTEMPTS": "2"}
    ttl = 3.0
    try:
        with host(tmp_path, "host-a", text_model_dir, fleet_url, "--lease-ttl", str(ttl), env=through) as a, \
                host(tmp_path, "host-b", text_model_dir, fleet_url) as b:
            conv = Conversation(a.get("/v1/models").json()["data"][0]["id"], "conv")
            first = conv.turn(a, [9, 8, 7], 6)
            assert a.post("/v1/sessions/conv/suspend").status_code == 200  # the fleet has turn 1
            pushed = RemoteStore(SessionStore(tmp_path / "reader"), fleet_url, host_id="reader").lease("conv")
            a_second = conv.turn(a, [6, 5], 5)  # resident on A, its lease renewed through the relay
            time.sleep(ttl / 2)
            a_third = conv.turn(a, [4], 3)  # renewed past half its TTL: A still serves it

            relay.down()
            time.sleep(ttl + 0.5)  # A's renewals fail until its lease expires
            assert "fleet_unavailable" in a.post("/v1/completions", json=conv.body([1], 3)).text  # 503
            # B takes the expired lease: every turn A finished was shipped before its answer (FORMAT.md 6.7)
            fourth = conv.turn(b, [6, 5], 5)
            relay.up()
            message = conv.refused(a, [2], 409, "session_held")  # B holds it now; A lost it
            assert "'host-b'" in message
            assert b.post("/v1/sessions/conv/suspend").status_code == 200
            fifth = conv.turn(a, [2, 1], 4)  # A pulls B's history over its own copy
            assert a.stop() == 0 and b.stop() == 0
    finally:
        relay.close()
    assert [first, a_second, a_third, fourth, fifth] == conv.reference(model)
    final = RemoteStore(SessionStore(tmp_path / "reader2"), fleet_url, host_id="reader").lease("conv")
    assert final.owner == "host-a" and final.released and final.generation > pushed.generation
    assert final.bundle_tokens == len(conv.history) - 1


def test_delete_on_a_fleet_server_deletes_from_the_fleet(tmp_path: Path, text_model_dir: Path,
                                                         fleet_url: str) -> None:
    with host(tmp_path, "host-a", text_model_dir, fleet_url) as a, \
            host(tmp_path, "host-b", text_model_dir, fleet_url) as b:
        conv = Conversation(a.get("/v1/models").json()["data"][0]["id"], "gone")
        conv.turn(a, [4, 5, 6], 3)
        assert b.post("/v1/sessions/gone/suspend").status_code == 404  # B never had it
        deleted = httpx.delete(b.url + "/v1/sessions/gone", timeout=60)
        assert deleted.status_code == 409 and "'host-a'" in deleted.text  # held live by A
        assert a.post("/v1/sessions/gone/suspend").status_code == 200
        remote = RemoteStore(SessionStore(tmp_path / "reader"), fleet_url, host_id="reader")
        assert remote.lease("gone").bundle is not None  # the fleet has a bundle of it now
        assert httpx.delete(b.url + "/v1/sessions/gone", timeout=60).status_code == 200  # only the fleet had it
        assert listed(a)["gone"]["state"] == "suspended"  # A's own copy, no longer the fleet's
        fresh = conv.turn(a, [4, 5, 6], 3)  # A's local copy is its own again: no bundle to pull
        assert fresh
        assert httpx.delete(a.url + "/v1/sessions/gone", timeout=60).status_code == 200
        assert "gone" not in listed(a) and "gone" not in listed(b)
        assert httpx.delete(a.url + "/v1/sessions/gone", timeout=60).status_code == 404
        assert a.stop() == 0 and b.stop() == 0
    assert remote.lease("gone") is None
    assert stored_keys(remote) == []  # no lease, no bundle left


def test_serve_remote_refuses_an_unreachable_store_in_one_line(tmp_path: Path, text_model_dir: Path,
                                                               fleet_url: str) -> None:
    proc = host(tmp_path, "host-a", text_model_dir, "s3://no-such-bucket/p")
    with pytest.raises(AssertionError, match="no-such-bucket"):
        proc.start()
    assert proc.proc is not None and proc.proc.wait(timeout=30) != 0
    assert "Traceback" not in proc.stderr()


def test_fleet_proxy_forwards_a_turn_to_the_holder_and_streams_its_answer(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any], fleet_url: str) -> None:
    """``--fleet-proxy``: a request reaching B for a session A holds live is forwarded to A (its
    --advertise-url) and answered from there, plain and streamed, token-exact; a request already
    forwarded once is never forwarded again (307)."""
    from tests.service.serverkit import free_port, sse_events

    model, _ = text_model
    pa = free_port()
    a = host(tmp_path, "a", text_model_dir, fleet_url, "--advertise-url", f"http://127.0.0.1:{pa}")
    a.port = pa
    pb = free_port()
    b = host(tmp_path, "b", text_model_dir, fleet_url, "--advertise-url", f"http://127.0.0.1:{pb}", "--fleet-proxy")
    b.port = pb
    with a, b:
        model_id = a.get("/v1/models").json()["data"][0]["id"]
        conv = Conversation(model_id, "px")
        conv.turn(a, [5, 6, 7], 4)  # A holds px now
        via_b = b.post("/v1/completions", json=conv.body([8], 5))
        assert via_b.status_code == 200, via_b.text
        assert via_b.headers["x-coli-served-by"] == f"http://127.0.0.1:{pa}"
        conv.turns.append((conv.body([8], 5)["prompt"], 5))
        conv.history = conv.turns[-1][0] + via_b.json()["choices"][0]["token_ids"]
        body = {**conv.body([9], 6), "stream": True}
        with httpx.stream("POST", b.url + "/v1/completions", json=body, timeout=120) as streamed:
            assert streamed.status_code == 200
            events = list(sse_events(streamed))
        tokens = events[-1]["choices"][0]["token_ids"]
        conv.turns.append((body["prompt"], 6))
        assert [via_b.json()["choices"][0]["token_ids"], tokens] == conv.reference(model)[1:]
        again = b.post("/v1/completions", json=conv.body([1], 2), headers={"X-Coli-Proxied-By": "a"})
        assert again.status_code == 307 and again.json()["error"]["code"] == "session_elsewhere"


def test_a_responses_chain_continues_on_another_host_from_the_object_store(
        tmp_path: Path, text_model_dir: Path, fleet_url: str) -> None:
    """A chain made on A (its records written to the fleet too), its session handed back (suspend:
    pushed, lease released): B, which never saw the chain, continues it with previous_response_id,
    token-exact against a stateless chat completion over the same messages."""
    a, b = host(tmp_path, "a", text_model_dir, fleet_url), host(tmp_path, "b", text_model_dir, fleet_url)
    with a, b:
        ca, cb = a.openai(), b.openai()
        model = ca.models.list().data[0].id
        extra = {"seed": 3}
        r1 = ca.responses.create(model=model, input="hello there", max_output_tokens=6, extra_body=extra)
        r2 = ca.responses.create(model=model, input="and then?", previous_response_id=r1.id,
                                 max_output_tokens=6, extra_body=extra)
        (sid,) = [d["id"] for d in listed(a).values() if d["id"].startswith("chain-")]
        assert a.post(f"/v1/sessions/{sid}/suspend").status_code == 200  # pushed, lease released
        assert cb.responses.retrieve(r2.id).output_text == r2.output_text  # from the object store
        r3 = cb.responses.create(model=model, input="go on", previous_response_id=r2.id, max_output_tokens=6,
                                 extra_body=extra)
        messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": r1.output_text},
                    {"role": "user", "content": "and then?"}, {"role": "assistant", "content": r2.output_text},
                    {"role": "user", "content": "go on"}]
        want = cb.chat.completions.create(model=model, messages=messages, max_tokens=6, seed=3)
        assert r3.output[0].content[0].token_ids == want.choices[0].token_ids
        assert r3.usage.input_tokens_details.cached_tokens > 0  # the session pulled, not prefilled again
        ca.responses.delete(r1.id)  # gone from the fleet too
        with pytest.raises(Exception, match="404|not found|No response"):
            cb.responses.retrieve(r1.id)
