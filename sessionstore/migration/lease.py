"""The lease record of the object-store tier (FORMAT.md 6.4): one JSON object per session that
says which host holds it and which bundle is current.

This module holds the record only (its fields, its bytes, its parser and the one wording of a
refusal); :mod:`lease_table` reads and writes it on the store, :mod:`lease_keeper` renews it.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

from kernels.errors import FormatError, LockedError
from sessionstore.migration.bundle_format import check_session_id, parse_json

LEASE_TTL_S = 900.0
MAX_LEASE_BYTES = 64 << 10
LEASE_FORMAT = "coli-lease"
LEASE_VERSION = 1


def default_host_id() -> str:
    """``COLI_HOST_ID`` or the host name: who holds a lease."""
    return os.environ.get("COLI_HOST_ID") or socket.gethostname()


def utc_stamp() -> str:
    """Now, as the lease's ``updated_utc`` (UTC, seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class Lease:
    """One lease object as read (``etag`` is the object's ETag at that read)."""

    session_id: str
    owner: str
    token: str
    generation: int
    expires_at: float
    ttl_s: float
    released: bool
    bundle: str | None  # key (under the bucket) of the current bundle
    bundle_tokens: int
    updated_utc: str
    etag: str = ""
    url: str | None = None  # where the holder serves (its ``serve --advertise-url``), for a 307 to it

    def live(self, now: float | None = None) -> bool:
        return not self.released and (time.time() if now is None else now) < self.expires_at

    def body(self) -> bytes:
        doc = {k: v for k, v in asdict(self).items() if k != "etag" and (k != "url" or v is not None)}
        return json.dumps({"format": LEASE_FORMAT, "version": LEASE_VERSION, **doc},
                          sort_keys=True).encode()

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "live": self.live()}

    def updated(self, **changes: Any) -> Lease:
        """This lease with ``changes`` applied and ``updated_utc`` set to now."""
        return Lease(**{**asdict(self), **changes, "updated_utc": utc_stamp()})

    def with_etag(self, etag: str) -> Lease:
        """This lease as the store holds it after a write that answered ``etag``."""
        return Lease(**{**asdict(self), "etag": etag})


def parse_lease(raw: bytes, etag: str, where: str) -> Lease:
    """The lease in ``raw`` (the object's bytes); FormatError naming ``where`` otherwise."""
    doc = parse_json(raw, where)
    if not isinstance(doc, dict) or doc.get("format") != LEASE_FORMAT or doc.get("version") != LEASE_VERSION:
        raise FormatError(f"{where}: not a version-{LEASE_VERSION} {LEASE_FORMAT} object")
    try:
        lease = Lease(session_id=check_session_id(doc["session_id"], where), owner=str(doc["owner"]),
                      token=str(doc["token"]), generation=int(doc["generation"]),
                      expires_at=float(doc["expires_at"]), ttl_s=float(doc["ttl_s"]),
                      released=bool(doc["released"]), bundle=doc["bundle"],
                      bundle_tokens=int(doc["bundle_tokens"]), updated_utc=str(doc["updated_utc"]),
                      etag=etag, url=check_advertise_url(doc.get("url"), where))
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{where}: lease field missing or of the wrong type ({exc})") from None
    if lease.bundle is not None and not isinstance(lease.bundle, str):
        raise FormatError(f"{where}: 'bundle' must be a key or null")
    return lease


def check_advertise_url(url: Any, where: str) -> str | None:
    """A holder's advertised URL as a lease may carry it: None, or ``http(s)://host[:port]`` (no
    path, no query, at most 256 characters); FormatError naming ``where`` otherwise."""
    if url is None:
        return None
    if (not isinstance(url, str) or len(url) > 256 or not re.fullmatch(r"https?://[A-Za-z0-9.\-\[\]:]+", url)):
        raise FormatError(f"{where}: an advertised URL must be http(s)://host[:port], found {str(url)[:80]!r}")
    return url


class HeldElsewhereError(LockedError):
    """Another host holds the session's lease live; ``holder_url``: where it serves, if it said."""

    def __init__(self, lease: Lease, now: float | None = None) -> None:
        super().__init__(held_message(lease, now))
        self.holder_url = lease.url


def held_message(lease: Lease, now: float | None = None) -> str:
    """The one wording of a refusal: another host holds the session's lease live."""
    left = lease.expires_at - (time.time() if now is None else now)
    return (f"session {lease.session_id!r} is held live by host {lease.owner!r} (lease generation "
            f"{lease.generation}, expires in {max(left, 0):.0f} s); it can be taken once that "
            "host releases it or its lease expires")


__all__ = [
    "LEASE_FORMAT",
    "LEASE_TTL_S",
    "LEASE_VERSION",
    "MAX_LEASE_BYTES",
    "HeldElsewhereError",
    "Lease",
    "check_advertise_url",
    "default_host_id",
    "held_message",
    "parse_lease",
    "utc_stamp",
]
