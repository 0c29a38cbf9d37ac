"""The objects of the sessions' write-through chains in the object store (FORMAT.md 6.7): each
session's *head* (``heads/<id>.json``) and its *segments* (``segments/<id>/<name>``).

:class:`ChainObjects` knows their keys and names, reads a head, writes one conditionally
(``If-Match`` / ``If-None-Match``: a lost write is a takeover, LockedError), and lists and deletes a
chain's segments. Which chain is current, and when to ship, compact or delete, is
:class:`~sessionstore.migration.shipping.TurnShipper`'s.
"""
from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from kernels.errors import ColiError, LockedError
from sessionstore.log import get_logger
from sessionstore.migration.object_store import ObjectPrefix, is_conflict
from sessionstore.migration.segment_format import MAX_HEAD_BYTES, Head, parse_head

log = get_logger("remote")

SEGMENT_SUFFIX = ".colisegment"
_SEGMENT_NAME = re.compile(r"g(\d{8})-r\d{12}-[0-9a-f]+" + re.escape(SEGMENT_SUFFIX))


def segment_name(generation: int, nrec: int) -> str:
    """A new segment's name: its lease generation, the records it ends at, a random part."""
    return f"g{generation:08d}-r{nrec:012d}-{secrets.token_hex(4)}{SEGMENT_SUFFIX}"


def segment_generation(key: str) -> int | None:
    """The lease generation in a segment's key (None: not a segment's name)."""
    found = _SEGMENT_NAME.fullmatch(key.rsplit("/", 1)[-1])
    return None if found is None else int(found.group(1))


class ChainObjects:
    """The heads and segments under one object-store prefix, as host ``host_id`` writes them."""

    def __init__(self, objects: ObjectPrefix, host_id: str) -> None:
        self.objects = objects
        self.host_id = host_id

    def head_key(self, session_id: str) -> str:
        return self.objects.key("heads", f"{session_id}.json")

    def segment_key(self, session_id: str, name: str) -> str:
        return self.objects.key("segments", session_id, name)

    def read_head(self, session_id: str) -> Head | None:
        """The head as stored now (None: no chain)."""
        key = self.head_key(session_id)
        with self.objects.failing("reading the head", session_id):
            found = self.objects.read_small(key, MAX_HEAD_BYTES)
        if found is None:
            return None
        raw, etag = found
        return parse_head(raw, etag, self.objects.url_of(key))

    def read_head_quietly(self, session_id: str) -> Head | None:
        """:meth:`read_head`, a failure logged and read as no head."""
        try:
            return self.read_head(session_id)
        except ColiError as exc:
            log.info("ship.head_read_failed", id=session_id, error=str(exc))
            return None

    def write_head(self, head: Head, expect: Head | None, what: str) -> tuple[Head, int]:
        """Conditionally write ``head`` over ``expect`` (None, or one without an etag, which this host
        started from a bundle before any head was stored: must not exist); (as written, its bytes).
        LockedError: another host's head write came first (a takeover claimed it)."""
        body = head.body()
        cond = {"IfNoneMatch": "*"} if expect is None or not expect.etag else {"IfMatch": expect.etag}
        with self.objects.failing(what, head.session_id):
            try:
                resp = self.objects.call("put_object", Key=self.head_key(head.session_id), Body=body, **cond)
            except Exception as exc:
                if is_conflict(exc, if_match="IfMatch" in cond):
                    raise LockedError(f"session {head.session_id!r}: its head was rewritten by another "
                                      "host (the chain was taken over); nothing more is shipped from "
                                      f"host {self.host_id!r}") from None
                raise
        return replace(head, etag=str(resp.get("ETag", ""))), len(body)

    def delete_head(self, head: Head) -> bool:
        """Delete the stored head if it is still ``head`` (If-Match); False when that failed."""
        try:
            self.objects.call("delete_object", Key=self.head_key(head.session_id), IfMatch=head.etag)
        except Exception as exc:  # a stale head is ignored by readers; best effort
            log.info("ship.head_delete_failed", id=head.session_id, error=str(exc))
            return False
        return True

    def segment_keys(self, session_id: str) -> Iterator[str]:
        """The keys of every object under ``segments/<id>/``, page by page (store errors raise)."""
        prefix = self.segment_key(session_id, "")
        page: dict[str, Any] = {"IsTruncated": True}
        while page.get("IsTruncated"):
            more = {"ContinuationToken": page["NextContinuationToken"]} if page.get("NextContinuationToken") else {}
            page = self.objects.call("list_objects_v2", Prefix=prefix, **more)
            for obj in page.get("Contents", []):
                yield str(obj["Key"])

    def delete_segments(self, session_id: str) -> None:
        """Delete every object under ``segments/<id>/`` (best effort: leftovers are never read)."""
        try:
            for key in self.segment_keys(session_id):
                self.objects.delete(key)
        except Exception as exc:  # a store failure: the next delete retries
            log.info("ship.segments_delete_failed", id=session_id, error=str(exc))

    def delete_chain(self, head: Head, keep: tuple[str | None, ...]) -> None:
        """Delete a replaced chain's segments and its base (unless ``keep`` names it). The chain
        that replaced it has no segment yet (a base or a pushed bundle): every segment goes."""
        self.delete_segments(head.session_id)
        if head.base is not None and head.base not in keep:
            self.objects.delete(head.base)


__all__ = ["SEGMENT_SUFFIX", "ChainObjects", "segment_generation", "segment_name"]
