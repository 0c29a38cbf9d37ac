"""A fleet behind Debian's stock nginx with the shipped ``deploy/nginx.conf``: two servers on one
object store (SeaweedFS, a real S3 server), each started with ``--advertise-url``; clients name sessions in
the ``X-Session-Id`` header only. nginx's consistent hash sends every turn of a session to one
server, so no turn is refused and each session's turns are token-exact against one uninterrupted
run; a request that reaches the other server directly is redirected (307) to the holder, and
following it gives the same turn; the header and a different body ``session`` is a 400.

Needs ``nginx`` on PATH (``.ci/run`` installs Debian's); ``COLI_NO_NGINX=1`` skips this file on purpose."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kernels.model.sampling import Sampler
from sessionstore.sessions import reference_turns
from tests.service.serverkit import REPO, ServerProc, free_port
from tests.support.seaweed import Bucket

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(os.environ.get("COLI_NO_NGINX") == "1", reason="COLI_NO_NGINX=1: skipped on purpose")]

SAMPLING = {"temperature": 0.9, "top_k": 40, "seed": 5}
SESSIONS = [f"conv-{i}" for i in range(8)]


class Nginx:
    """nginx in the foreground with the shipped config, its listen and upstream ports replaced."""

    def __init__(self, prefix: Path, listen: int, upstreams: list[int]) -> None:
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(binary).exists():
            raise AssertionError("nginx is not installed (apt-get install nginx; COLI_NO_NGINX=1 skips this test)")
        conf = (REPO / "deploy" / "nginx.conf").read_text()
        assert "127.0.0.1:8000;" in conf and "server 127.0.0.1:8001;" in conf and "server 127.0.0.1:8002;" in conf
        conf = conf.replace("127.0.0.1:8000;", f"127.0.0.1:{listen};")
        conf = conf.replace("server 127.0.0.1:8001;", f"server 127.0.0.1:{upstreams[0]};")
        conf = conf.replace("server 127.0.0.1:8002;", f"server 127.0.0.1:{upstreams[1]};")
        prefix.mkdir(parents=True, exist_ok=True)
        (prefix / "nginx.conf").write_text(conf)
        self.log = open(prefix / "nginx.stderr", "wb")  # closed in stop()
        self.proc = subprocess.Popen([binary, "-p", str(prefix), "-c", str(prefix / "nginx.conf")],
                                     stdout=self.log, stderr=self.log)
        self.url = f"http://127.0.0.1:{listen}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise AssertionError("nginx never proxied /healthz: "
                                     + (prefix / "nginx.stderr").read_text(errors="replace")[-2000:])
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.log.close()


def _turn(url: str, sid: str, model_id: str, prompt: list[int], n: int, *, follow: bool = False,
          body_session: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model": model_id, "prompt": prompt, "max_tokens": n, "ignore_eos": True, **SAMPLING}
    if body_session is not None:
        body["session"] = body_session
    return httpx.post(url + "/v1/completions", json=body, headers={"X-Session-Id": sid}, timeout=120,
                      follow_redirects=follow)


def _local(server: ServerProc) -> set[str]:
    """The sessions this server holds (their leases), as its listing says."""
    return {d["id"] for d in server.get("/v1/sessions").json()["data"] if d["fleet"]["held"]}


def test_nginx_routes_each_session_to_one_server_and_the_other_redirects(
        tmp_path: Path, text_model_dir: Path, text_model: tuple[Any, Any],
        s3_bucket: Bucket) -> None:
    model, _ = text_model
    fleet = s3_bucket.url("nginx")
    ports = [free_port(), free_port()]
    servers = [ServerProc(tmp_path / name, text_model_dir, "--remote", fleet, "--host-id", name,
                          "--advertise-url", f"http://127.0.0.1:{port}", log_dir=tmp_path, port=port)
               for name, port in zip(("a", "b"), ports, strict=True)]
    with servers[0] as a, servers[1] as b:
        proxy = Nginx(tmp_path / "nginx", free_port(), ports)
        try:
            model_id = httpx.get(proxy.url + "/v1/models").json()["data"][0]["id"]
            history = {sid: [] for sid in SESSIONS}
            turns: dict[str, list[tuple[list[int], int]]] = {sid: [] for sid in SESSIONS}
            got: dict[str, list[list[int]]] = {sid: [] for sid in SESSIONS}
            for round_ in range(2):  # the second round in reverse: a round-robin balancer would swap every host
                for i, sid in (enumerate(SESSIONS) if round_ == 0 else reversed(list(enumerate(SESSIONS)))):
                    prompt = history[sid] + [3 + i, 9 - round_]
                    reply = _turn(proxy.url, sid, model_id, prompt, 6)
                    assert reply.status_code == 200, reply.text  # never refused: always its holder
                    tokens = reply.json()["choices"][0]["token_ids"]
                    assert reply.json()["session"]["id"] == sid
                    turns[sid].append((prompt, 6))
                    got[sid].append(tokens)
                    history[sid] = prompt + tokens
            held = [_local(a), _local(b)]
            assert held[0] | held[1] == set(SESSIONS) and not held[0] & held[1]
            assert held[0] and held[1], held  # the hash spreads these eight over both servers
            sampler = Sampler.checked(SAMPLING["temperature"], SAMPLING["top_k"], 1.0, SAMPLING["seed"])
            for sid in SESSIONS:
                assert got[sid] == reference_turns(model, "fp8", turns[sid], sampler), sid

            sid = sorted(held[0])[0]  # held by A, asked of B directly
            prompt = history[sid] + [4]
            moved = _turn(b.url, sid, model_id, prompt, 5)
            assert moved.status_code == 307, moved.text
            assert moved.headers["location"] == f"http://127.0.0.1:{ports[0]}/v1/completions"
            assert moved.json()["error"]["code"] == "session_elsewhere"
            followed = _turn(b.url, sid, model_id, prompt, 5, follow=True)
            assert followed.status_code == 200, followed.text
            turns[sid].append((prompt, 5))
            assert [*got[sid], followed.json()["choices"][0]["token_ids"]] == reference_turns(
                model, "fp8", turns[sid], sampler)

            mismatch = _turn(proxy.url, sid, model_id, [1, 2], 2, body_session="another")
            assert mismatch.status_code == 400 and mismatch.json()["error"]["code"] == "session_mismatch"
        finally:
            proxy.stop()
