"""The ``bundles/`` objects of the object-store tier (FORMAT.md 6.4): how a new bundle is named,
and the deletion of the ones no lease points at any more.

Bundles are immutable: a push uploads a NEW object ``bundles/<id>/g<generation>-<token>.colibundle``
and only then moves the lease's pointer to it. Superseded bundles (and the uploads of failed
pushes) are deleted after the pointer moved; later generations belong to a successor and are
never touched.
"""
from __future__ import annotations

import re
import secrets
from typing import Any

from sessionstore.log import get_logger
from sessionstore.migration.lease import Lease
from sessionstore.migration.lease_table import LeaseTable
from sessionstore.migration.object_store import ObjectPrefix, one_line
from sessionstore.migration.transport import store_errors

log = get_logger("remote")

BUNDLE_SUFFIX = ".colibundle"
BUNDLE_NAME = re.compile(r"g([0-9]{1,18})-[0-9a-f]+" + re.escape(BUNDLE_SUFFIX))


class BundleShelf:
    """The bundle objects under one prefix: new names, and deleting what is superseded."""

    def __init__(self, objects: ObjectPrefix, leases: LeaseTable) -> None:
        self.objects = objects
        self.leases = leases

    def new_key(self, session_id: str, held: Lease) -> tuple[str, str]:
        """(name, key) for a fresh bundle of ``session_id`` under the lease ``held``."""
        name = f"g{held.generation:08d}-{secrets.token_hex(4)}{BUNDLE_SUFFIX}"
        return name, self.objects.key("bundles", session_id, name)

    def discard(self, session_id: str, key: str) -> None:
        """Delete an upload the lease does not point at; left for the next push's sweep when
        the store cannot tell (unreachable)."""
        stored, readable = self.leases.stored(session_id)
        if not readable or (stored is not None and stored.bundle == key):
            return
        self.objects.delete(key)

    def sweep(self, session_id: str, current: Lease) -> None:
        """Delete every bundle of ``session_id`` of generation <= the pointer's other than the
        one it points at (superseded ones, uploads of failed pushes) and abort their unfinished
        multipart uploads. Later generations belong to a successor and are left alone."""
        prefix = self.objects.key("bundles", session_id) + "/"
        keys: list[str] = []
        try:  # listed directly: s3fs's listing cache would hide objects from later opens
            page: dict[str, Any] = {"IsTruncated": True}
            while page.get("IsTruncated"):
                more = {"ContinuationToken": page["NextContinuationToken"]} \
                    if page.get("NextContinuationToken") else {}
                page = self.objects.call("list_objects_v2", Prefix=prefix, **more)
                keys += [str(obj["Key"]) for obj in page.get("Contents", [])]
            uploads = self.objects.call("list_multipart_uploads", Prefix=prefix).get("Uploads", [])
        except store_errors() as exc:
            log.info("remote.sweep_failed", id=session_id, error=one_line(exc))
            return
        for key in keys:
            if superseded(key, prefix, current):
                self.objects.delete(key)
        for up in uploads:
            if superseded(str(up.get("Key", "")), prefix, current):
                try:
                    self.objects.call("abort_multipart_upload", Key=up["Key"], UploadId=up["UploadId"])
                except store_errors() as exc:
                    log.info("remote.abort_failed", key=up["Key"], error=str(exc))


def superseded(key: str, prefix: str, current: Lease) -> bool:
    """Whether ``key`` (under ``prefix``) is a bundle that ``current`` replaced."""
    match = BUNDLE_NAME.fullmatch(key[len(prefix):]) if key.startswith(prefix) else None
    if match is None or key == current.bundle:
        return False
    return int(match[1]) <= current.generation


__all__ = ["BUNDLE_NAME", "BUNDLE_SUFFIX", "BundleShelf", "superseded"]
