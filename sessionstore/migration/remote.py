"""The object-store tier: push suspended sessions to ``s3://bucket/prefix``, pull them anywhere,
and an ownership lease so that at most one host holds a session live (FORMAT.md 6.4).

Objects under the prefix::

    leases/<id>.json                               the lease AND the pointer to the current bundle
    bundles/<id>/g<generation>-<token>.colibundle  bundles (immutable; superseded ones are deleted)

The lease is a small JSON object changed only by S3 conditional writes: created with
``If-None-Match: *``, then replaced with ``If-Match: <the ETag we read>``. The conditional write
decides: a write the store accepted landed (even if another host takes the lease a moment
later), a writer that got 412 lost and the caller a LockedError. A write whose answer was lost
(the store or the link died, or the client's retry of a landed write got 412) is settled by
reading the object back: our exact body there means it landed. A lease is *live* until
``expires_at`` (wall clock of the host that took it; keep hosts NTP-synced: skew eats into the
TTL) or until it is released.

- ``pull`` takes the lease (refused while another host holds it live), downloads the bundle the
  lease points at, and imports it. The lease stays ours: this host now owns the session.
- ``push`` needs the lease (or a session the fleet has no bundle of, whose lease is not live
  elsewhere): it uploads a NEW bundle object, then moves the pointer with a conditional write
  (optionally releasing), then deletes the superseded bundles (and any upload a failed push
  left behind). A host whose lease was taken over meanwhile fails that write: its upload is
  deleted, the new owner's pointer is untouched. A released lease cannot be pushed over without
  pulling first.
- ``resume`` / ``begin_turn`` open the session live; a :class:`LeaseKeeper` renews its lease
  while it stays resident and refuses its commits once the lease is lost.

Every failure of the store itself (unreachable, bucket missing, request refused) is one
:class:`RemoteStoreError` naming the URL, the operation and the session.
Endpoint and credentials: the AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...)
or ``storage_options`` (fsspec/s3fs options), so AWS S3, MinIO and Ceph RGW all work.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from kernels.errors import (
    ColiError,
    FormatError,
    LimitError,
    LockedError,
    NotFoundError,
)
from sessionstore.kvfile import WriterLock
from sessionstore.log import get_logger
from sessionstore.migration import migrate
from sessionstore.migration.bundle import check_session_id, parse_json
from sessionstore.migration.lease_keeper import LeaseKeeper
from sessionstore.migration.transport import open_sink, open_source, store_errors, url_filesystem
from sessionstore.sessions import SessionStore

log = get_logger("remote")

LEASE_TTL_S = 900.0
MAX_LEASE_BYTES = 64 << 10
LEASE_FORMAT = "coli-lease"
LEASE_VERSION = 1
BUNDLE_SUFFIX = ".colibundle"
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
_BUNDLE_NAME = re.compile(r"g([0-9]{1,18})-[0-9a-f]+" + re.escape(BUNDLE_SUFFIX))


class RemoteStoreError(ColiError):
    """The object store failed an operation (unreachable, bucket missing, request refused)."""

    exit_code = 1


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


def _error_code(exc: BaseException) -> tuple[str, str]:
    """(S3 error code, HTTP status) of a failed request, from botocore's response if any."""
    for err in (exc, exc.__cause__, exc.__context__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            return (str(response.get("Error", {}).get("Code", "")),
                    str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")))
    return "", ""


def _is_conflict(exc: BaseException) -> bool:
    if isinstance(exc, FileExistsError):
        return True
    code, status = _error_code(exc)
    if code or status:
        return code in _CONFLICT_CODES or status in ("409", "412")
    return "pre-condition" in str(exc).lower() or "precondition" in str(exc).lower()


def _no_bucket(exc: BaseException) -> bool:
    return _error_code(exc)[0] == "NoSuchBucket" or "bucket does not exist" in str(exc).lower()


def held_message(lease: Lease, now: float | None = None) -> str:
    """The one wording of a refusal: another host holds the session's lease live."""
    left = lease.expires_at - (time.time() if now is None else now)
    return (f"session {lease.session_id!r} is held live by host {lease.owner!r} (lease generation "
            f"{lease.generation}, expires in {max(left, 0):.0f} s); it can be taken once that "
            "host releases it or its lease expires")


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

    # --- keys and failures -------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def lease_key(self, session_id: str) -> str:
        return self._key("leases", f"{check_session_id(session_id, 'lease')}.json")

    def _url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    @contextmanager
    def _failing(self, what: str, session_id: str | None) -> Iterator[None]:
        """Turn a failure of the store inside the block into one RemoteStoreError line."""
        try:
            yield
        except ColiError:
            raise
        except store_errors() as exc:
            raise RemoteStoreError(self._failure(what, session_id, exc)) from None

    def _failure(self, what: str, session_id: str | None, exc: BaseException) -> str:
        if _no_bucket(exc):
            reason = (f"the bucket {self.bucket!r} does not exist (the store lost its data, or the "
                      "URL names the wrong bucket)")
        else:
            reason = " ".join(str(exc).split()) or type(exc).__name__
        whose = f" for session {session_id!r}" if session_id else ""
        return f"remote object store {self.url}: {what}{whose} failed: {reason}"

    # --- lease objects -----------------------------------------------------------------------
    def lease(self, session_id: str) -> Lease | None:
        """The lease as stored now (None: the remote has never seen this session)."""
        with self._failing("reading the lease", session_id):
            return self._read_lease(session_id)

    def _read_lease(self, session_id: str) -> Lease | None:
        key = self.lease_key(session_id)
        try:
            resp = self.fs.call_s3("get_object", Bucket=self.bucket, Key=key)
        except FileNotFoundError as exc:
            if _no_bucket(exc):
                raise
            return None
        size = int(resp.get("ContentLength") or 0)
        if size > MAX_LEASE_BYTES:
            raise LimitError(f"{self._url(key)}: lease object of {size} bytes exceeds {MAX_LEASE_BYTES}")
        from fsspec.asyn import sync

        raw = sync(self.fs.loop, resp["Body"].read)
        return _lease_from(raw, resp["ETag"], self._url(key))

    def _write(self, lease: Lease, *, expect: Lease | None, what: str) -> Lease:
        """Conditionally write ``lease`` over ``expect`` (None: must not exist); the lease as
        written (with its new ETag). LockedError: another host's write came first."""
        key = self.lease_key(lease.session_id)
        cond = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": expect.etag}
        with self._failing(what, lease.session_id):
            try:
                resp = self.fs.call_s3("put_object", Bucket=self.bucket, Key=key,
                                       Body=lease.body(), **cond)
            except Exception as exc:
                stored, readable = self._stored(lease.session_id)
                if stored is not None and stored.body() == lease.body():
                    return stored  # it landed: the answer was lost, or a retry of it got 412
                if _is_conflict(exc):
                    raise self._refusal(lease.session_id, stored if readable else None) from None
                raise
        written = Lease(**{**asdict(lease), "etag": str(resp.get("ETag", ""))})
        self._confirm(written)
        return written

    def _stored(self, session_id: str) -> tuple[Lease | None, bool]:
        """(the lease now, whether it could be read): the read that settles a lost answer."""
        unreadable: tuple[type[BaseException], ...] = (ColiError, *store_errors())
        try:
            return self._read_lease(session_id), True
        except unreadable as exc:
            log.info("lease.readback_failed", id=session_id, error=" ".join(str(exc).split()))
            return None, False

    def _confirm(self, written: Lease) -> None:
        """Read a landed write back: another token of the SAME generation there means the
        store let two conditional writes win (its check is not atomic); ours lost. A later
        generation is a successor (another host took the lease after ours): ours landed."""
        now, _ = self._stored(written.session_id)
        if now is not None and now.token != written.token and now.generation == written.generation:
            raise LockedError(f"session {written.session_id!r}: the store accepted another "
                              f"host's write of the same lease generation; {held_message(now)}")

    def _refusal(self, session_id: str, cur: Lease | None) -> LockedError:
        if cur is not None and cur.live() and cur.owner != self.host_id:
            return LockedError(held_message(cur))
        return LockedError(f"session {session_id!r}: another host changed its lease at the same "
                           "moment; try again")

    def acquire(self, session_id: str) -> Lease:
        """Take (or renew) the lease; LockedError while another host holds it live."""
        cur = self.lease(session_id)
        now = time.time()
        if cur is not None and cur.live(now) and cur.owner != self.host_id:
            raise LockedError(held_message(cur, now))
        lease = Lease(session_id, self.host_id, secrets.token_hex(16),
                      (cur.generation + 1) if cur else 1, now + self.lease_ttl, self.lease_ttl,
                      False, cur.bundle if cur else None, cur.bundle_tokens if cur else 0,
                      _utc())
        held = self._write(lease, expect=cur, what="taking the lease")
        log.info("lease.acquire", id=session_id, host=self.host_id, generation=held.generation,
                 took_over=bool(cur and not cur.released and cur.owner != self.host_id))
        return held

    def _held(self, session_id: str) -> Lease:
        cur = self.lease(session_id)
        if cur is not None and cur.live() and cur.owner != self.host_id:
            raise LockedError(held_message(cur))
        if cur is None or cur.owner != self.host_id or cur.released:
            who = "nobody" if cur is None else (f"released by {cur.owner}" if cur.released
                                                else f"expired, {cur.owner}")
            raise LockedError(f"session {session_id!r}: this host ({self.host_id}) does not hold "
                              f"its lease ({who}); pull it first")
        return cur

    def renew(self, session_id: str) -> Lease:
        """Extend our lease (LockedError if it was lost: another host took it after expiry)."""
        cur = self._held(session_id)
        return self._write(_replace(cur, expires_at=time.time() + self.lease_ttl), expect=cur,
                           what="renewing the lease")

    def release(self, session_id: str) -> Lease | None:
        """Give the session up: any host may pull it now. A lease that never pointed at a
        bundle is deleted instead (None): nothing of the session stays on the store. Any host
        may clear such a lease once it expired (its creator's first push never landed)."""
        cur = self.lease(session_id)
        if cur is not None and cur.bundle is None and (cur.owner == self.host_id or not cur.live()):
            self._forget(cur)
            log.info("lease.release", id=session_id, host=self.host_id, generation=cur.generation,
                     deleted=True)
            return None
        cur = self._held(session_id)
        out = self._write(_replace(cur, released=True), expect=cur, what="releasing the lease")
        log.info("lease.release", id=session_id, host=self.host_id, generation=out.generation)
        return out

    def _forget(self, lease: Lease) -> None:
        """Delete a lease that points at no bundle, only as read (If-Match)."""
        key = self.lease_key(lease.session_id)
        with self._failing("deleting the bundle-less lease", lease.session_id):
            try:
                self.fs.call_s3("delete_object", Bucket=self.bucket, Key=key, IfMatch=lease.etag)
            except FileNotFoundError:
                return
            except Exception as exc:
                if _is_conflict(exc):
                    raise self._refusal(lease.session_id, self._stored(lease.session_id)[0]) from None
                raise

    # --- bundles -----------------------------------------------------------------------------
    def push(self, session_id: str, *, release: bool = True) -> tuple[migrate.MigrateResult, Lease]:
        """Upload the session's last commit as a new bundle and point the lease at it.

        The session must be suspended here (no live writer) when ``release``: the local writer
        lock is held for the whole push so nothing starts generating meanwhile. The push landed
        once the pointer write is accepted; superseded bundles are deleted after it.
        """
        cur = self.lease(session_id)
        fresh = cur is None or (cur.bundle is None and not cur.live())
        if not fresh and cur is not None and (cur.owner != self.host_id or cur.released):
            self._held(session_id)  # raises with the holder's name
        guard = WriterLock(self.store.kv_path(session_id)) if release else None
        if guard is not None:
            guard.acquire()  # LockedError: the session is live in this host; suspend it first
        try:
            # the fleet has no bundle and nobody holds the id live: this host creates it
            held = self.acquire(session_id) if fresh else self.renew(session_id)
            name = f"g{held.generation:08d}-{secrets.token_hex(4)}{BUNDLE_SUFFIX}"
            key = self._key("bundles", session_id, name)
            try:
                with self._failing(f"push (uploading bundle {name})", session_id), \
                        open_sink(self._url(key), overwrite=True,  # a fresh random key: no existence check
                                  storage_options=self.storage_options) as (sink, _):
                    result = migrate.export_session(self.store, session_id, sink,
                                                    compression=self.compression)
                out = self._write(_replace(held, bundle=key, bundle_tokens=result.tokens,
                                           released=release), expect=held,
                                  what=f"push (pointing the lease at bundle {name})")
            except BaseException:
                self._discard(session_id, key)
                raise
        finally:
            if guard is not None:
                guard.release()
        self._sweep(session_id, out)
        log.info("remote.push", id=session_id, host=self.host_id, key=key, tokens=result.tokens,
                 released=release)
        return result, out

    def _discard(self, session_id: str, key: str) -> None:
        """Delete an upload the lease does not point at; left for the next push's sweep when
        the store cannot tell (unreachable)."""
        stored, readable = self._stored(session_id)
        if not readable or (stored is not None and stored.bundle == key):
            return
        self._delete(key)

    def _sweep(self, session_id: str, current: Lease) -> None:
        """Delete every bundle of ``session_id`` of generation <= the pointer's other than the
        one it points at (superseded ones, uploads of failed pushes) and abort their unfinished
        multipart uploads. Later generations belong to a successor and are left alone."""
        prefix = self._key("bundles", session_id) + "/"
        keys: list[str] = []
        try:  # listed directly: s3fs's listing cache would hide objects from later opens
            page: dict[str, Any] = {"IsTruncated": True}
            while page.get("IsTruncated"):
                more = {"ContinuationToken": page["NextContinuationToken"]} \
                    if page.get("NextContinuationToken") else {}
                page = self.fs.call_s3("list_objects_v2", Bucket=self.bucket, Prefix=prefix, **more)
                keys += [str(obj["Key"]) for obj in page.get("Contents", [])]
            uploads = self.fs.call_s3("list_multipart_uploads", Bucket=self.bucket,
                                      Prefix=prefix).get("Uploads", [])
        except store_errors() as exc:
            log.info("remote.sweep_failed", id=session_id, error=" ".join(str(exc).split()))
            return
        for key in keys:
            if self._superseded(key, prefix, current):
                self._delete(key)
        for up in uploads:
            if self._superseded(str(up.get("Key", "")), prefix, current):
                try:
                    self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=up["Key"],
                                    UploadId=up["UploadId"])
                except store_errors() as exc:
                    log.info("remote.abort_failed", key=up["Key"], error=str(exc))

    @staticmethod
    def _superseded(key: str, prefix: str, current: Lease) -> bool:
        match = _BUNDLE_NAME.fullmatch(key[len(prefix):]) if key.startswith(prefix) else None
        if match is None or key == current.bundle:
            return False
        return int(match[1]) <= current.generation

    def pull(self, session_id: str, *, replace: bool = False,
             model: str | os.PathLike[str] | None = None) -> tuple[migrate.MigrateResult, Lease]:
        """Take the lease and import the bundle it points at; the lease stays ours."""
        cur = self.lease(session_id)
        if cur is not None and cur.live() and cur.owner != self.host_id:
            raise LockedError(held_message(cur))
        if cur is None or cur.bundle is None:
            raise NotFoundError(f"{self.url}: no bundle for session {session_id!r} (nothing of it "
                                "was pushed)")
        if self.store.exists(session_id) and not replace:
            raise FormatError(f"session {session_id!r} already exists in {self.store.root}; give "
                              "--replace to take the remote copy")
        held = self.acquire(session_id)
        assert held.bundle is not None
        # a listing s3fs cached earlier in this process must not hide a bundle pushed since
        self.fs.invalidate_cache(f"{self.bucket}/{held.bundle}")
        try:
            with self._failing(f"pull (downloading bundle {held.bundle.rsplit('/', 1)[-1]})",
                               session_id), \
                    open_source(self._url(held.bundle), storage_options=self.storage_options) as src:
                result = migrate.import_bundle(self.store, src, source_name=self._url(held.bundle),
                                               replace=replace, model=model)
        except BaseException:
            try:  # hand the session back as it was: released, same bundle
                self._write(_replace(held, released=True), expect=held, what="giving the lease back")
            except ColiError as exc:
                log.info("lease.giveback_failed", id=session_id, error=str(exc))
            raise
        log.info("remote.pull", id=session_id, host=self.host_id, key=held.bundle,
                 tokens=result.tokens)
        return result, held

    def resume(self, session_id: str, model_source: str | os.PathLike[str] | None = None,
               **session_options: Any) -> Any:
        """Open the session live on this host: pull it unless this host already holds it (or
        the fleet has no bundle of it and the local copy is the only one).

        While it stays resident a :class:`LeaseKeeper` renews the lease every
        ``renew_interval`` s and fences its commits (LockedError once the lease is lost)."""
        cur = self.lease(session_id)
        if cur is not None and cur.live() and cur.owner != self.host_id:
            raise LockedError(held_message(cur))
        local = self.store.exists(session_id)
        if cur is not None and cur.owner == self.host_id and not cur.released and local:
            held = self.renew(session_id)
        elif (cur is None or cur.bundle is None) and local:
            held = self.acquire(session_id)
        else:
            _, held = self.pull(session_id, replace=True)
        return self._keep(self.store.open(session_id, model_source, **session_options), held)

    def begin_turn(self, session_id: str, open_local: Callable[[], tuple[Any, bool]],
                   model_source: str | os.PathLike[str] | None = None,
                   **session_options: Any) -> tuple[Any, bool]:
        """(session, created) for one turn through the fleet, its lease held and kept.

        A session the fleet has a bundle of is resumed (:meth:`resume`). Otherwise this host
        takes the lease FIRST (a conditional create: of two hosts creating the same id one
        wins, the other is refused as held by the winner), then ``open_local`` opens its own
        copy or creates the session; a failure there deletes the lease again."""
        cur = self.lease(session_id)
        if cur is not None and cur.bundle is not None:
            return self.resume(session_id, model_source, **session_options), False
        held = self.acquire(session_id)
        if held.bundle is not None:  # another host pushed it meanwhile: continue from its bundle
            _, held = self.pull(session_id, replace=True)
            return self._keep(self.store.open(session_id, model_source, **session_options),
                              held), False
        try:
            session, created = open_local()
        except BaseException:
            try:
                self._forget(held)
            except ColiError as exc:
                log.info("lease.forget_failed", id=session_id, error=str(exc))
            raise
        return self._keep(session, held), created

    def _keep(self, session: Any, held: Lease) -> Any:
        session.guard_with(LeaseKeeper(self, held.session_id, held,
                                       interval=self.renew_interval).start())
        return session

    def list(self) -> list[Lease]:
        """Every session the remote knows (from the lease objects)."""
        with self._failing("listing the leases", None):
            try:
                names = self.fs.ls(f"{self.bucket}/{self._key('leases')}", detail=False,
                                   refresh=True)
            except FileNotFoundError as exc:
                if _no_bucket(exc):
                    raise
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
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=key)
            self.fs.invalidate_cache(f"{self.bucket}/{key}")
        except store_errors() as exc:
            log.info("remote.delete_failed", key=key, error=" ".join(str(exc).split()))


def _replace(lease: Lease, **changes: Any) -> Lease:
    fields = {**asdict(lease), **changes, "updated_utc": _utc()}
    return Lease(**fields)


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


__all__ = [
    "LEASE_TTL_S",
    "Lease",
    "RemoteStore",
    "RemoteStoreError",
    "default_host_id",
    "held_message",
]
