"""Buckets on the run's SeaweedFS (tools/_seaweed.py starts it; the session-scoped ``seaweed``
fixture of ``tests/conftest.py`` starts ONE per test run and the ``s3_bucket`` fixture gives each
test a fresh bucket on it, the AWS environment pointing there, so s3fs here and the servers a test
starts find it the standard way). A missing binary is an install error (it is in the test extra),
reported as one clear failure, never a skip.
"""
from __future__ import annotations

from dataclasses import dataclass

from tools._seaweed import SeaweedS3


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
    first write of a non-empty object (an empty one is kept in the filer, no volume): ~0.2 s, in
    every test that writes. Done for a batch of buckets at once (one write and its delete in each,
    in parallel threads) it costs about 0.3-0.5 s for the whole batch. Every bucket is handed out
    once, empty."""

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
            client.put_object(Bucket=name, Key="warm", Body=b"warm")  # an empty body stays in the filer
            client.delete_object(Bucket=name, Key="warm")

        with ThreadPoolExecutor(n) as pool:
            list(pool.map(warm, names))
        return names


__all__ = ["Bucket", "BucketPool"]
