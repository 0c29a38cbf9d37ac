"""Small named objects of a fleet beside its bundles and leases: ``<prefix>/<kind>/<name>`` (the
Responses API's records, FORMAT.md 7.3: ``responses/<id>.json``), each written whole by one PUT and
read back bounded, so any host of the fleet finds what another wrote."""
from __future__ import annotations

from kernels.errors import LimitError
from sessionstore.migration.object_store import ObjectPrefix


class ObjectRecords:
    """The objects of one ``kind`` under a fleet's prefix."""

    def __init__(self, objects: ObjectPrefix, kind: str, max_bytes: int) -> None:
        self.objects, self.kind, self.max_bytes = objects, kind, max_bytes

    def key(self, name: str) -> str:
        return self.objects.key(self.kind, name)

    def put(self, name: str, data: bytes) -> None:
        """Write ``name`` whole (a failure is one RemoteStoreError line)."""
        if len(data) > self.max_bytes:
            raise LimitError(f"{self.kind}/{name}: {len(data)} bytes, limit {self.max_bytes}")
        with self.objects.failing(f"writing {self.kind}/{name}", None):
            self.objects.call("put_object", Key=self.key(name), Body=data)

    def get(self, name: str) -> bytes | None:
        """``name``'s bytes, or None when the fleet has no such object."""
        key = self.key(name)
        with self.objects.failing(f"reading {self.kind}/{name}", None):
            found = self.objects.read_small(key, self.max_bytes)
        return None if found is None else found[0]

    def delete(self, name: str) -> None:
        """Delete ``name``, best effort."""
        self.objects.delete(self.key(name))


__all__ = ["ObjectRecords"]
