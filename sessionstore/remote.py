"""The object-store tier: push suspended sessions to ``s3://bucket/prefix``, pull them anywhere,
and an ownership lease so that at most one host holds a session live.

Objects under the prefix::

    leases/<id>.json                               the lease AND the pointer to the current bundle
    bundles/<id>/g<generation>-<token>.colibundle  bundles (immutable; older ones are deleted)

The lease is a small JSON object changed only by S3 conditional writes: created with
``If-None-Match: *``, then replaced with ``If-Match: <the ETag we read>``; a writer that lost
the race gets 412 and the caller a LockedError. After every write the lease is read back and our
random token must be in it (so a server whose conditional check is not atomic still yields at
most one winner in practice). A lease is *live* until ``expires_at`` (wall clock of the host
that took it; keep hosts NTP-synced: skew eats into the TTL) or until it is released.

- ``pull`` takes the lease (refused while another host holds it live), downloads the bundle the
  lease points at, and imports it. The lease stays ours: this host now owns the session.
- ``push`` needs the lease (or a session the remote has never seen): it uploads a NEW bundle
  object, then moves the pointer with a conditional write (optionally releasing). A host whose
  lease was taken over meanwhile fails that write: its upload is deleted, the new owner's
  pointer is untouched. A released lease cannot be pushed over without pulling first.
- ``resume`` opens the session live; a :class:`LeaseKeeper` renews its lease while it stays
  resident and refuses its commits once the lease is lost (sessionstore/lease_keeper.py).

Endpoint and credentials: the AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...)
or ``storage_options`` (fsspec/s3fs options), so AWS S3, MinIO and Ceph RGW all work.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

from kernels.errors import ColiError, FormatError, LimitError, LockedError, NotFoundError
from sessionstore import migrate
from sessionstore.bundle import check_session_id, parse_json
from sessionstore.lease_keeper import LeaseKeeper
from sessionstore.lock import WriterLock
from sessionstore.log import get_logger
from sessionstore.store import SessionStore
from sessionstore.transport import open_sink, open_source, url_filesystem

log = get_logger("remote")

LEASE_TTL_S = 900.0
MAX_LEASE_BYTES = 64 << 10
LEASE_FORMAT = "coli-lease"
LEASE_VERSION = 1
BUNDLE_SUFFIX = ".colibundle"
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}


def default_host_id() -> str:
    """``COLI_HOST_ID`` or the host name: who holds a lease."""
    return os.environ.get("COLI_HOST_ID") or socket.gethostname()


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

    def live(self, now: float | None = None) -> bool:
        return not self.released and (time.time() if now is None else now) < self.expires_at

    def body(self) -> bytes:
        doc = {k: v for k, v in asdict(self).items() if k != "etag"}
        return json.dumps({"format": LEASE_FORMAT, "version": LEASE_VERSION, **doc},
                          sort_keys=True).encode()

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "live": self.live()}


def _lease_from(raw: bytes, etag: str, where: str) -> Lease:
    doc = parse_json(raw, where)
    if not isinstance(doc, dict) or doc.get("format") != LEASE_FORMAT or doc.get("version") != LEASE_VERSION:
        raise FormatError(f"{where}: not a version-{LEASE_VERSION} {LEASE_FORMAT} object")
    try:
        lease = Lease(session_id=check_session_id(doc["session_id"], where), owner=str(doc["owner"]),
                      token=str(doc["token"]), generation=int(doc["generation"]),
                      expires_at=float(doc["expires_at"]), ttl_s=float(doc["ttl_s"]),
                      released=bool(doc["released"]), bundle=doc["bundle"],
                      bundle_tokens=int(doc["bundle_tokens"]), updated_utc=str(doc["updated_utc"]),
                      etag=etag)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{where}: lease field missing or of the wrong type ({exc})") from None
    if lease.bundle is not None and not isinstance(lease.bundle, str):
        raise FormatError(f"{where}: 'bundle' must be a key or null")
    return lease


def _is_conflict(exc: BaseException) -> bool:
    if isinstance(exc, FileExistsError):
        return True
    cause = exc.__cause__
    response = getattr(cause, "response", None) or getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return err.get("Code") in _CONFLICT_CODES or status in ("409", "412")
    return "pre-condition" in str(exc).lower() or "precondition" in str(exc).lower()


class RemoteStore:
    """A local ``SessionStore`` paired with an S3 prefix holding bundles and leases."""

    def __init__(self, store: SessionStore, url: str, *, host_id: str | None = None,
                 lease_ttl: float = LEASE_TTL_S, storage_options: dict[str, Any] | None = None,
                 compression: str | int = "auto", renew_interval: float | None = None) -> None:
        if not url.startswith("s3://"):
            raise FormatError(f"{url}: the remote tier needs an S3 API URL (s3://bucket/prefix)")
        self.store = store
        self.url = url.rstrip("/")
        self.host_id = host_id or default_host_id()
        self.lease_ttl = float(lease_ttl)
        if not 0 < self.lease_ttl <= 7 * 86400:
            raise LimitError(f"lease TTL {lease_ttl} s outside (0, 7 days]")
        self.renew_interval = self.lease_ttl / 3 if renew_interval is None else float(renew_interval)
        if not 0 < self.renew_interval:
            raise LimitError(f"lease renewal interval {renew_interval} s must be > 0")
        self.storage_options = storage_options
        self.compression = compression
        self.fs, path = url_filesystem(self.url, storage_options)
        self.bucket, _, self.prefix = path.partition("/")
        if not self.bucket:
            raise FormatError(f"{url}: no bucket")

    # --- keys --------------------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def lease_key(self, session_id: str) -> str:
        return self._key("leases", f"{check_session_id(session_id, 'lease')}.json")

    def _url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # --- lease objects -----------------------------------------------------------------------
    def lease(self, session_id: str) -> Lease | None:
        """The lease as stored now (None: the remote has never seen this session)."""
        key = self.lease_key(session_id)
        try:
            resp = self.fs.call_s3("get_object", Bucket=self.bucket, Key=key)
        except FileNotFoundError:
            return None
        size = int(resp.get("ContentLength") or 0)
        if size > MAX_LEASE_BYTES:
            raise LimitError(f"{self._url(key)}: lease object of {size} bytes exceeds {MAX_LEASE_BYTES}")
        from fsspec.asyn import sync

        raw = sync(self.fs.loop, resp["Body"].read)
        return _lease_from(raw, resp["ETag"], self._url(key))

    def _write(self, lease: Lease, *, expect: Lease | None) -> Lease:
        """Conditionally write ``lease`` over ``expect`` (None: must not exist); read it back."""
        key = self.lease_key(lease.session_id)
        cond = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": expect.etag}
        try:
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=key, Body=lease.body(), **cond)
        except OSError as exc:
            if _is_conflict(exc):
                raise LockedError(f"session {lease.session_id!r}: another host changed its lease "
                                  "at the same moment; it holds the session") from None
            raise
        now = self.lease(lease.session_id)
        if now is None or now.token != lease.token:
            holder = "nobody" if now is None else now.owner
            raise LockedError(f"session {lease.session_id!r}: lost the lease race to {holder}")
        return now

    def acquire(self, session_id: str) -> Lease:
        """Take (or renew) the lease; LockedError while another host holds it live."""
        cur = self.lease(session_id)
        now = time.time()
        if cur is not None and cur.live(now) and cur.owner != self.host_id:
            raise LockedError(
                f"session {session_id!r} is held live by host {cur.owner!r} (lease generation "
                f"{cur.generation}, expires in {cur.expires_at - now:.0f} s); it can be taken "
                "once that host releases it or its lease expires")
        lease = Lease(session_id, self.host_id, secrets.token_hex(16),
                      (cur.generation + 1) if cur else 1, now + self.lease_ttl, self.lease_ttl,
                      False, cur.bundle if cur else None, cur.bundle_tokens if cur else 0,
                      _utc())
        held = self._write(lease, expect=cur)
        log.info("lease.acquire", id=session_id, host=self.host_id, generation=held.generation,
                 took_over=bool(cur and not cur.released and cur.owner != self.host_id))
        return held

    def _held(self, session_id: str) -> Lease:
        cur = self.lease(session_id)
        if cur is None or cur.owner != self.host_id or cur.released:
            who = "nobody" if cur is None else (f"released by {cur.owner}" if cur.released else cur.owner)
            raise LockedError(f"session {session_id!r}: this host ({self.host_id}) does not hold "
                              f"its lease (held: {who}); pull it first")
        return cur

    def renew(self, session_id: str) -> Lease:
        """Extend our lease (LockedError if it was lost: another host took it after expiry)."""
        cur = self._held(session_id)
        return self._write(_replace(cur, expires_at=time.time() + self.lease_ttl), expect=cur)

    def release(self, session_id: str) -> Lease:
        """Give the session up: any host may pull it now."""
        cur = self._held(session_id)
        out = self._write(_replace(cur, released=True), expect=cur)
        log.info("lease.release", id=session_id, host=self.host_id, generation=out.generation)
        return out

    # --- bundles -----------------------------------------------------------------------------
    def push(self, session_id: str, *, release: bool = True) -> tuple[migrate.MigrateResult, Lease]:
        """Upload the session's last commit as a new bundle and point the lease at it.

        The session must be suspended here (no live writer) when ``release``: the local writer
        lock is held for the whole push so nothing starts generating meanwhile.
        """
        cur = self.lease(session_id)
        if cur is None:
            cur = self.acquire(session_id)
        elif cur.owner != self.host_id or cur.released:
            self._held(session_id)  # raises with the holder's name
        guard = WriterLock(self.store.kv_path(session_id)) if release else None
        if guard is not None:
            guard.acquire()  # LockedError: the session is live in this host; suspend it first
        try:
            held = self.renew(session_id)
            key = self._key("bundles", session_id,
                            f"g{held.generation:08d}-{secrets.token_hex(4)}{BUNDLE_SUFFIX}")
            with open_sink(self._url(key), overwrite=False,
                           storage_options=self.storage_options) as (sink, _):
                result = migrate.export_session(self.store, session_id, sink,
                                                compression=self.compression)
            try:
                out = self._write(_replace(held, bundle=key, bundle_tokens=result.tokens,
                                           released=release), expect=held)
            except LockedError:
                self._delete(key)
                raise
        finally:
            if guard is not None:
                guard.release()
        if cur.bundle and cur.bundle != key:
            self._delete(cur.bundle)
        log.info("remote.push", id=session_id, host=self.host_id, key=key, tokens=result.tokens,
                 released=release)
        return result, out

    def pull(self, session_id: str, *, replace: bool = False,
             model: str | os.PathLike[str] | None = None) -> tuple[migrate.MigrateResult, Lease]:
        """Take the lease and import the bundle it points at; the lease stays ours."""
        cur = self.lease(session_id)
        if cur is None or cur.bundle is None:
            raise NotFoundError(f"{self.url}: no bundle for session {session_id!r}")
        if self.store.exists(session_id) and not replace:
            raise FormatError(f"session {session_id!r} already exists in {self.store.root}; give "
                              "--replace to take the remote copy")
        held = self.acquire(session_id)
        try:
            with open_source(self._url(held.bundle), storage_options=self.storage_options) as src:
                result = migrate.import_bundle(self.store, src, source_name=self._url(held.bundle),
                                               replace=replace, model=model)
        except BaseException:
            try:  # hand the session back as it was: released, same bundle
                self._write(_replace(held, released=True), expect=held)
            except ColiError as exc:
                log.warning("lease.giveback_failed", id=session_id, error=str(exc))
            raise
        log.info("remote.pull", id=session_id, host=self.host_id, key=held.bundle,
                 tokens=result.tokens)
        return result, held

    def resume(self, session_id: str, model_source: str | os.PathLike[str] | None = None,
               **session_options: Any) -> Any:
        """Open the session live on this host: pull it unless this host already holds it.

        While it stays resident a :class:`LeaseKeeper` renews the lease every
        ``renew_interval`` s and fences its commits (LockedError once the lease is lost)."""
        cur = self.lease(session_id)
        if cur is not None and cur.owner == self.host_id and not cur.released \
                and self.store.exists(session_id):
            held = self.renew(session_id)
        else:
            _, held = self.pull(session_id, replace=True)
        session = self.store.open(session_id, model_source, **session_options)
        session.guard_with(LeaseKeeper(self, session_id, held, interval=self.renew_interval).start())
        return session

    def list(self) -> list[Lease]:
        """Every session the remote knows (from the lease objects)."""
        try:
            names = self.fs.ls(f"{self.bucket}/{self._key('leases')}", detail=False, refresh=True)
        except FileNotFoundError:
            return []
        out = []
        for name in sorted(names):
            base = name.rsplit("/", 1)[-1]
            if base.endswith(".json"):
                lease = self.lease(base[:-5])
                if lease is not None:
                    out.append(lease)
        return out

    def _delete(self, key: str) -> None:
        try:
            self.fs.rm(f"{self.bucket}/{key}")
        except OSError as exc:
            log.warning("remote.delete_failed", key=key, error=str(exc))


def _replace(lease: Lease, **changes: Any) -> Lease:
    fields = {**asdict(lease), **changes, "updated_utc": _utc()}
    return Lease(**fields)


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


__all__ = ["RemoteStore", "Lease", "LEASE_TTL_S", "default_host_id"]
