"""The lease objects of the object-store tier (FORMAT.md 6.4): read, take, renew, release.

A lease is a small JSON object changed only by S3 conditional writes: created with
``If-None-Match: *``, then replaced with ``If-Match: <the ETag we read>``. The conditional write
decides: a write the store accepted landed (even if another host takes the lease a moment
later), a writer that got 412 lost and the caller a LockedError. A write whose answer was lost
(the store or the link died, or the client's retry of a landed write got 412) is settled by
reading the object back: our exact body there means it landed. A lease is *live* until
``expires_at`` (wall clock of the host that took it; keep hosts NTP-synced: skew eats into the
TTL) or until it is released.
"""
from __future__ import annotations

import secrets
import time

from kernels.errors import ColiError, LockedError
from sessionstore.log import get_logger
from sessionstore.migration.bundle_format import check_session_id
from sessionstore.migration.lease import (
    MAX_LEASE_BYTES,
    HeldElsewhereError,
    Lease,
    held_message,
    parse_lease,
    utc_stamp,
)
from sessionstore.migration.object_store import ObjectPrefix, is_conflict, no_bucket, one_line
from sessionstore.migration.transport import store_errors

log = get_logger("remote")


class LeaseTable:
    """The ``leases/`` objects under one prefix, as seen and changed by host ``host_id``."""

    def __init__(self, objects: ObjectPrefix, host_id: str, lease_ttl: float, advertise_url: str | None = None) -> None:
        self.objects = objects
        self.host_id = host_id
        self.lease_ttl = lease_ttl
        self.advertise_url = advertise_url  # written into the leases this host takes (a 307's target)

    def key(self, session_id: str) -> str:
        return self.objects.key("leases", f"{check_session_id(session_id, 'lease')}.json")

    # --- reading -----------------------------------------------------------------------------
    def lease(self, session_id: str) -> Lease | None:
        """The lease as stored now (None: the remote has never seen this session)."""
        with self.objects.failing("reading the lease", session_id):
            return self._read(session_id)

    def _read(self, session_id: str) -> Lease | None:
        key = self.key(session_id)
        found = self.objects.read_small(key, MAX_LEASE_BYTES)
        if found is None:
            return None
        raw, etag = found
        return parse_lease(raw, etag, self.objects.url_of(key))

    def stored(self, session_id: str) -> tuple[Lease | None, bool]:
        """(the lease now, whether it could be read): the read that settles a lost answer."""
        unreadable: tuple[type[BaseException], ...] = (ColiError, *store_errors())
        try:
            return self._read(session_id), True
        except unreadable as exc:
            log.info("lease.readback_failed", id=session_id, error=one_line(exc))
            return None, False

    def list(self) -> list[Lease]:
        """Every session the remote knows (from the lease objects)."""
        objects = self.objects
        with objects.failing("listing the leases", None):
            try:
                names = objects.fs.ls(f"{objects.bucket}/{objects.key('leases')}", detail=False,
                                      refresh=True)
            except FileNotFoundError as exc:
                if no_bucket(exc):
                    raise
                return []
        # in session-id order, whatever order the store lists in (FORMAT.md 6.4, "What stores answer")
        bases = (name.rsplit("/", 1)[-1] for name in names)
        out = []
        for session_id in sorted(base[:-5] for base in bases if base.endswith(".json")):
            lease = self.lease(session_id)
            if lease is not None:
                out.append(lease)
        return out

    # --- conditional writes ------------------------------------------------------------------
    def write(self, lease: Lease, *, expect: Lease | None, what: str) -> Lease:
        """Conditionally write ``lease`` over ``expect`` (None: must not exist); the lease as
        written (with its new ETag). LockedError: another host's write came first."""
        key = self.key(lease.session_id)
        cond = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": expect.etag}
        with self.objects.failing(what, lease.session_id):
            try:
                resp = self.objects.call("put_object", Key=key, Body=lease.body(), **cond)
            except Exception as exc:
                stored, readable = self.stored(lease.session_id)
                if stored is not None and stored.body() == lease.body():
                    return stored  # it landed: the answer was lost, or a retry of it got 412
                if is_conflict(exc, if_match=expect is not None):
                    raise self._refusal(lease.session_id, stored if readable else None) from None
                raise
        written = lease.with_etag(str(resp.get("ETag", "")))
        self._confirm(written)
        return written

    def _confirm(self, written: Lease) -> None:
        """Read a landed write back: another token of the SAME generation there means the
        store let two conditional writes win (its check is not atomic); ours lost. A later
        generation is a successor (another host took the lease after ours): ours landed."""
        now, _ = self.stored(written.session_id)
        if now is not None and now.token != written.token and now.generation == written.generation:
            raise LockedError(f"session {written.session_id!r}: the store accepted another "
                              f"host's write of the same lease generation; {held_message(now)}")

    def _refusal(self, session_id: str, cur: Lease | None) -> LockedError:
        if cur is not None and cur.live() and cur.owner != self.host_id:
            return HeldElsewhereError(cur)
        return LockedError(f"session {session_id!r}: another host changed its lease at the same "
                           "moment; try again")

    # --- the life cycle ----------------------------------------------------------------------
    def acquire(self, session_id: str) -> Lease:
        """Take (or renew) the lease; LockedError while another host holds it live."""
        cur = self.lease(session_id)
        now = time.time()
        if cur is not None and cur.live(now) and cur.owner != self.host_id:
            raise HeldElsewhereError(cur, now)
        lease = Lease(session_id, self.host_id, secrets.token_hex(16),
                      (cur.generation + 1) if cur else 1, now + self.lease_ttl, self.lease_ttl,
                      False, cur.bundle if cur else None, cur.bundle_tokens if cur else 0,
                      utc_stamp(), url=self.advertise_url)
        held = self.write(lease, expect=cur, what="taking the lease")
        log.info("lease.acquire", id=session_id, host=self.host_id, generation=held.generation,
                 took_over=bool(cur and not cur.released and cur.owner != self.host_id))
        return held

    def held(self, session_id: str) -> Lease:
        """The lease as stored, which this host must hold (LockedError naming who does)."""
        cur = self.lease(session_id)
        if cur is not None and cur.live() and cur.owner != self.host_id:
            raise HeldElsewhereError(cur)
        if cur is None or cur.owner != self.host_id or cur.released:
            who = "nobody" if cur is None else (f"released by {cur.owner}" if cur.released
                                                else f"expired, {cur.owner}")
            raise LockedError(f"session {session_id!r}: this host ({self.host_id}) does not hold "
                              f"its lease ({who}); pull it first")
        return cur

    def renew(self, session_id: str) -> Lease:
        """Extend our lease (LockedError if it was lost: another host took it after expiry)."""
        cur = self.held(session_id)
        return self.write(cur.updated(expires_at=time.time() + self.lease_ttl), expect=cur,
                          what="renewing the lease")

    def release(self, session_id: str) -> Lease | None:
        """Give the session up: any host may pull it now. A lease that never pointed at a
        bundle is deleted instead (None): nothing of the session stays on the store. Any host
        may clear such a lease once it expired (its creator's first push never landed)."""
        cur = self.lease(session_id)
        if cur is not None and cur.bundle is None and (cur.owner == self.host_id or not cur.live()):
            self.forget(cur)
            log.info("lease.release", id=session_id, host=self.host_id, generation=cur.generation,
                     deleted=True)
            return None
        cur = self.held(session_id)
        out = self.write(cur.updated(released=True), expect=cur, what="releasing the lease")
        log.info("lease.release", id=session_id, host=self.host_id, generation=out.generation)
        return out

    def forget(self, lease: Lease) -> None:
        """Delete a lease that points at no bundle, only as read (If-Match)."""
        key = self.key(lease.session_id)
        with self.objects.failing("deleting the bundle-less lease", lease.session_id):
            try:
                self.objects.call("delete_object", Key=key, IfMatch=lease.etag)
            except Exception as exc:
                if not is_conflict(exc, if_match=True):
                    raise
                # a lease already gone is answered 404 (AWS, moto) or 412 (SeaweedFS): read back
                stored, readable = self.stored(lease.session_id)
                if readable and stored is None:
                    return
                raise self._refusal(lease.session_id, stored) from None


__all__ = ["LeaseTable"]
