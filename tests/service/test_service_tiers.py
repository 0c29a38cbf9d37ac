"""The store's tiers on real servers (issue 25 part 2, FORMAT.md 5.10): ``--max-disk-bytes`` with
``--remote`` (a real S3 server, SeaweedFS, on loopback) holds the disk under load by offloading the
least recently used idle sessions and restores them token-exact, across a restart too; without
``--remote`` a turn that could pass the budget is a 507 and nothing is lost; ``retention_seconds``
and ``pinned`` (in a turn's body and by ``PATCH /v1/sessions/{id}``) expire sessions locally and
in the object store, never a pinned one; the metrics count it all."""
from __future__ import annotations

import threading
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
from tests.support.seaweed import Bucket

pytestmark = pytest.mark.timeout(300)

SAMPLING = {"temperature": 0.9, "top_k": 40, "seed": 5}
# bytes of kv files: a session here is ~168 KB on disk (its writer's headroom), a turn's bound ~170-190 KB; three
# clients' turns fit at once, the eight sessions (~1.34 MB) do not: they keep going out and coming back
BUDGET = 1_000_000
CLIENTS = 3


@pytest.fixture
def fleet_url(s3_bucket: Bucket) -> str:
    return s3_bucket.url("fleet")


class Conversation:
    """One conversation of completions turns (each prompt the whole history plus new ids)."""

    def __init__(self, model_id: str, sid: str) -> None:
        self.model_id, self.sid = model_id, sid
        self.history: list[int] = []
        self.turns: list[tuple[list[int], int]] = []
        self.got: list[list[int]] = []

    def turn(self, server: ServerProc, new: list[int], max_tokens: int, **extra: Any) -> httpx.Response:
        prompt = self.history + new
        body = {"model": self.model_id, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "session": self.sid, **SAMPLING, **extra}
        response = server.post("/v1/completions", json=body)
        if response.status_code == 200:
            tokens = response.json()["choices"][0]["token_ids"]
            self.turns.append((prompt, max_tokens))
            self.got.append(tokens)
            self.history = prompt + tokens
        return response

    def reference(self, model: Any) -> list[list[int]]:
        sampler = Sampler.checked(SAMPLING["temperature"], SAMPLING["top_k"], 1.0, SAMPLING["seed"])
        return reference_turns(model, "fp8", self.turns, sampler)


def session_files_on_disk(root: Path) -> dict[str, dict[str, int]]:
    """Every file of the local sessions under ``root`` now, kv files, sidecars, manifests and
    records alike (what --max-disk-bytes bounds; an offloaded stub's few small files are not), by
    session and name."""
    seen: dict[str, dict[str, int]] = {}
    for d in (root / "sessions").iterdir():
        files: dict[str, int] = {}
        try:
            for f in d.iterdir():
                if f.is_file() and not f.is_symlink():
                    files[f.name] = f.stat().st_size
        except FileNotFoundError:  # a temporary file renamed, or the directory replaced, while read:
            continue  # the server's writes go on beside this watcher; the next look counts it
        if "kv.coli_kv" in files:  # else an offloaded stub, or a directory being replaced
            seen[d.name] = files
    return seen


def session_bytes_on_disk(root: Path) -> int:
    return sum(sum(files.values()) for files in session_files_on_disk(root).values())


def bundles_of(remote: RemoteStore, sid: str) -> list[str]:
    """The bundle objects of ``sid`` in the object store now."""
    return stored_keys(remote, "bundles", sid)


def metric(server: ServerProc, name: str) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def listed(server: ServerProc) -> dict[str, dict[str, Any]]:
    response = server.get("/v1/sessions?limit=1000")
    assert response.status_code == 200, response.text
    return {d["id"]: d for d in response.json()["data"]}


def wait_for(predicate: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.1)


class DiskWatch:
    """Samples the session files' bytes under a store every few ms while running; ``peak`` the most seen.

    A walk over the directories is not a snapshot: on a loaded machine it can take long enough that
    a session counted early is offloaded and another restored before the walk ends, and the sum of
    two instants overstates either. A sample counts only when two walks in a row saw the same files
    at the same sizes: a state the disk really held, whatever the machine's speed (a real overrun
    holds still long enough: five new sessions' 1,068,225 bytes, when the tiers' plans left out a new
    session's bound before its catalogue row existed). ``samples`` counts them."""

    def __init__(self, root: Path) -> None:
        self.root, self.peak, self.samples = root, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = session_files_on_disk(self.root)
        while not self._stop.is_set():
            time.sleep(0.005)
            now = session_files_on_disk(self.root)
            if now == last:
                self.samples += 1
                self.peak = max(self.peak, sum(sum(files.values()) for files in now.values()))
            last = now

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_disk_budget_held_under_load_offload_and_restore_exact_across_a_restart(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any], fleet_url: str) -> None:
    model, _ = text_model
    root = tmp_path / "host"
    args = ("--remote", fleet_url, "--host-id", "host-a", "--max-disk-bytes", str(BUDGET), "--max-resident", "2",
            "--sweep-interval", "0.5")
    server = ServerProc(root, text_model_dir, *args, log_dir=tmp_path).start()
    try:
        model_id = server.get("/v1/models").json()["data"][0]["id"]
        convs = [Conversation(model_id, f"c{i}") for i in range(8)]
        failures: list[str] = []

        def run(group: list[Conversation], round_no: int) -> None:
            for conv in group:
                response = conv.turn(server, [7 + round_no, 3 + len(conv.history) % 5], 12)
                if response.status_code != 200:
                    failures.append(f"{conv.sid}: {response.status_code} {response.text}")

        with DiskWatch(root) as watch:
            for round_no in range(3):  # three rounds; in each, three clients at once over the 8 sessions
                threads = [threading.Thread(target=run, args=(convs[i::CLIENTS], round_no)) for i in range(CLIENTS)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        assert not failures, failures
        assert watch.samples >= 10 and watch.peak > BUDGET // 2, (watch.samples, watch.peak)  # it watched a load
        assert watch.peak <= BUDGET, f"the session files reached {watch.peak} bytes, over {BUDGET}"
        offloads, restores = metric(server, "coli_tier_offloads_total"), metric(server, "coli_tier_restores_total")
        assert offloads >= 3 and restores >= 2, (offloads, restores)
        states = {sid: d["state"] for sid, d in listed(server).items()}
        offloaded = sorted(sid for sid, state in states.items() if state == "offloaded")
        assert offloaded and set(states) == {c.sid for c in convs}, states
        assert metric(server, 'coli_tier_bytes{tier="object_store"}') > 0
        assert server.stop() == 0

        # the LRU order and the stubs survive a restart: the offloaded sessions are still listed so and a
        # turn on each restores it token-exact (the budget holds: others go out as they come back)
        server = ServerProc(root, text_model_dir, *args, log_dir=tmp_path).start()
        again = listed(server)
        assert sorted(sid for sid, d in again.items() if d["state"] == "offloaded") == offloaded
        stub = offloaded[0]  # what needs its records is refused until a turn restores it
        for response in (server.post(f"/v1/sessions/{stub}/fork", json={"new": "copy"}),
                         server.get(f"/v1/sessions/{stub}/bundle"), server.get(f"/v1/sessions/{stub}?history=1")):
            assert response.status_code == 409, response.text
            assert response.json()["error"]["code"] == "session_offloaded"
        assert server.get(f"/v1/sessions/{stub}").json()["state"] == "offloaded"
        with DiskWatch(root) as watch:
            for conv in convs:
                assert conv.turn(server, [2], 6).status_code == 200
        assert watch.peak <= BUDGET
        assert metric(server, "coli_tier_restores_total") >= len(offloaded)
        for conv in convs:
            assert conv.got == conv.reference(model), conv.sid

        # an offloaded session past its retention goes from this disk and from the object store
        victim = next(sid for sid, d in listed(server).items() if d["state"] == "offloaded")
        patched = httpx.patch(server.url + f"/v1/sessions/{victim}", json={"retention_seconds": 1})
        assert patched.status_code == 200, patched.text
        assert patched.json()["state"] == "offloaded" and patched.json()["retention_seconds"] == 1
        wait_for(lambda: victim not in listed(server), 20, f"{victim} expired")
        assert not (root / "sessions" / victim).exists()
        remote = RemoteStore(SessionStore(tmp_path / "reader"), fleet_url, host_id="reader")
        assert remote.lease(victim) is None
        assert bundles_of(remote, victim) == []
        assert metric(server, "coli_tier_expiries_total") == 1
        assert server.stop() == 0
    finally:
        server.stop()


def test_retention_expires_locally_and_remotely_never_a_pinned_session(
        tmp_path: Path, text_model_dir: Path, fleet_url: str) -> None:
    with ServerProc(tmp_path / "host", text_model_dir, "--remote", fleet_url, "--host-id", "host-a",
                    "--sweep-interval", "0.3", log_dir=tmp_path) as server:
        model_id = server.get("/v1/models").json()["data"][0]["id"]
        short = Conversation(model_id, "short")
        pinned = Conversation(model_id, "pinned")
        kept = Conversation(model_id, "kept")
        assert short.turn(server, [4, 5], 4, retention_seconds=3600).status_code == 200
        assert pinned.turn(server, [4, 6], 4, retention_seconds=1, pinned=True).status_code == 200
        assert kept.turn(server, [4, 7], 4).status_code == 200
        for sid in ("short", "pinned", "kept"):  # each pushed to the object store and released
            assert server.post(f"/v1/sessions/{sid}/suspend").status_code == 200
        remote = RemoteStore(SessionStore(tmp_path / "reader"), fleet_url, host_id="reader")
        lease = remote.lease("short")
        assert lease is not None and lease.bundle is not None and bundles_of(remote, "short")
        described = server.get("/v1/sessions/pinned").json()
        assert described["pinned"] is True and described["retention_seconds"] == 1
        assert listed(server)["short"]["retention_seconds"] == 3600
        assert httpx.patch(server.url + "/v1/sessions/short", json={"retention_seconds": 1}).status_code == 200

        wait_for(lambda: "short" not in listed(server), 20, "short expired")
        assert remote.lease("short") is None
        assert bundles_of(remote, "short") == []
        time.sleep(1.0)  # more sweeps: the pinned one and the one without retention stay
        assert set(listed(server)) == {"pinned", "kept"}
        assert remote.lease("pinned") is not None

        # unpinned by PATCH, it expires too; kept gets a retention by PATCH and goes as well
        assert httpx.patch(server.url + "/v1/sessions/pinned", json={"pinned": False}).status_code == 200
        assert httpx.patch(server.url + "/v1/sessions/kept", json={"retention_seconds": 1}).status_code == 200
        wait_for(lambda: not listed(server), 20, "pinned and kept expired")
        assert remote.lease("pinned") is None and remote.lease("kept") is None
        assert metric(server, "coli_tier_expiries_total") == 3


def test_without_remote_a_turn_that_could_pass_the_budget_is_507_and_nothing_is_lost(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any]) -> None:
    model, _ = text_model
    budget = 450_000  # a session here is ~205 KB (kv ~168 KB), a new one's bound ~212 KB: two fit, not three
    root = tmp_path / "host"
    with ServerProc(root, text_model_dir, "--max-disk-bytes", str(budget), "--sweep-interval", "0.3",
                    log_dir=tmp_path) as server:
        model_id = server.get("/v1/models").json()["data"][0]["id"]
        a, b, c = (Conversation(model_id, sid) for sid in ("a", "b", "c"))
        assert a.turn(server, [5, 6, 7], 20).status_code == 200
        assert b.turn(server, [5, 6, 8], 20).status_code == 200
        before = server.get("/v1/sessions/a?history=1").json()["history"]

        refused = c.turn(server, [5, 6, 9], 20)
        assert refused.status_code == 507, refused.text
        err = refused.json()["error"]
        assert err["code"] == "insufficient_storage" and "--max-disk-bytes" in err["message"]
        assert "/" + root.name not in err["message"]  # no server path
        assert server.get("/v1/sessions/c").status_code == 404  # nothing written for it
        streamed = server.post("/v1/completions", json={"model": model_id, "prompt": [1, 2], "max_tokens": 500,
                                                         "session": "a", "stream": True, "ignore_eos": True})
        assert streamed.status_code == 507, streamed.text  # a would grow past the budget: refused before any text
        assert server.get("/v1/sessions/a?history=1").json()["history"] == before  # nothing lost
        assert server.post("/v1/completions", json={"model": model_id, "prompt": [1, 2],
                                                     "max_tokens": 3}).status_code == 200  # stateless: served
        assert a.turn(server, [3], 4).status_code == 200  # a small turn on a still fits
        assert a.got == a.reference(model)
        assert session_bytes_on_disk(root) <= budget

        # retention frees room: b expires, then c fits
        assert httpx.patch(server.url + "/v1/sessions/b", json={"retention_seconds": 1}).status_code == 200
        wait_for(lambda: "b" not in listed(server), 20, "b expired")
        assert c.turn(server, [5, 6, 9], 20).status_code == 200
        assert c.got == c.reference(model)


def test_patch_and_body_fields_are_checked(tmp_path: Path, text_model_dir: Path) -> None:
    with ServerProc(tmp_path / "host", text_model_dir, log_dir=tmp_path) as server:
        model_id = server.get("/v1/models").json()["data"][0]["id"]
        url = server.url + "/v1/sessions/"
        assert httpx.patch(url + "nope", json={"pinned": True}).json()["error"]["code"] == "session_not_found"
        body = {"model": model_id, "prompt": [1, 2], "max_tokens": 2}
        no_session = server.post("/v1/completions", json={**body, "retention_seconds": 60})
        assert no_session.status_code == 400 and no_session.json()["error"]["param"] == "retention_seconds"
        for bad, param in (({"retention_seconds": 0}, "retention_seconds"), ({"retention_seconds": "60"},
                           "retention_seconds"), ({"pinned": "yes"}, "pinned"), ({"retention_seconds": 1.5},
                           "retention_seconds")):
            r = server.post("/v1/completions", json={**body, "session": "s", **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        assert server.get("/v1/sessions/s").status_code == 404  # a refused first turn leaves nothing
        ok = server.post("/v1/completions", json={**body, "session": "s", "retention_seconds": 3600, "pinned": True})
        assert ok.status_code == 200, ok.text
        d = server.get("/v1/sessions/s").json()
        assert (d["retention_seconds"], d["pinned"]) == (3600, True)
        for bad in ({}, {"other": 1}, {"retention_seconds": -1}, {"pinned": None, "x": 2}):
            r = httpx.patch(url + "s", json=bad)
            assert r.status_code == 400, (bad, r.text)
        r = httpx.patch(url + "s", json={"retention_seconds": None})
        assert r.status_code == 200 and r.json()["retention_seconds"] is None and r.json()["pinned"] is True
        assert listed(server)["s"]["retention_seconds"] is None
