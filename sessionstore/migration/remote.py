"""The object-store tier: push suspended sessions to ``s3://bucket/prefix``, pull them anywhere,
and an ownership lease so that at most one host holds a session live (FORMAT.md 6.4).

:class:`RemoteStore` moves sessions between a local ``SessionStore`` and the fleet's prefix; the
pieces it is made of live apart: :mod:`object_store` (keys, requests, failures as one line),
:mod:`lease` (the record), :mod:`lease_table` (the conditional writes that take, renew and release
it), :mod:`bundle_shelf` (bundle names, deleting superseded ones), :mod:`lease_keeper` (renewal
while a session stays live).

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
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from kernels.errors import ColiError, FormatError, LimitError, NotFoundError
from sessionstore.kvfile import WriterLock
from sessionstore.log import get_logger
from sessionstore.migration.bundle_shelf import BundleShelf
from sessionstore.migration.exporting import MigrateResult, export_session
from sessionstore.migration.lease import (
    LEASE_TTL_S,
    HeldElsewhereError,
    Lease,
    check_advertise_url,
    default_host_id,
)
from sessionstore.migration.lease_keeper import LeaseKeeper
from sessionstore.migration.lease_table import LeaseTable
from sessionstore.migration.migrate import import_bundle
from sessionstore.migration.object_store import ObjectPrefix
from sessionstore.migration.transport import open_sink, open_source
from sessionstore.sessions import DEFAULT_SESSION_OPTIONS, SessionOptions, SessionStore

log = get_logger("remote")


class RemoteStore:
    """A local ``SessionStore`` paired with an S3 prefix holding bundles and leases."""

    def __init__(self, store: SessionStore, url: str, *, host_id: str | None = None,
                 lease_ttl: float = LEASE_TTL_S, storage_options: dict[str, Any] | None = None,
                 compression: str | int = "auto", renew_interval: float | None = None,
                 advertise_url: str | None = None) -> None:
        if not url.startswith("s3://"):
            raise FormatError(f"{url}: the remote tier needs an S3 API URL (s3://bucket/prefix)")
        self.store = store
        ttl = float(lease_ttl)
        if not 0 < ttl <= 7 * 86400:
            raise LimitError(f"lease TTL {lease_ttl} s outside (0, 7 days]")
        self.renew_interval = ttl / 3 if renew_interval is None else float(renew_interval)
        if not 0 < self.renew_interval:
            raise LimitError(f"lease renewal interval {renew_interval} s must be > 0")
        self.compression = compression
        self.objects = ObjectPrefix(url, storage_options)
        self.leases = LeaseTable(self.objects, host_id or default_host_id(), ttl,
                                 check_advertise_url(advertise_url, "--advertise-url"))
        self.bundles = BundleShelf(self.objects, self.leases)

    # --- where, and who ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.objects.url

    @property
    def fs(self) -> Any:
        return self.objects.fs

    @property
    def bucket(self) -> str:
        return self.objects.bucket

    @property
    def prefix(self) -> str:
        return self.objects.prefix

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return self.objects.storage_options

    @property
    def host_id(self) -> str:
        return self.leases.host_id

    @property
    def lease_ttl(self) -> float:
        return self.leases.lease_ttl

    # --- the lease (see LeaseTable) ----------------------------------------------------------
    def lease(self, session_id: str) -> Lease | None:
        """The lease as stored now (None: the remote has never seen this session)."""
        return self.leases.lease(session_id)

    def acquire(self, session_id: str) -> Lease:
        """Take (or renew) the lease; LockedError while another host holds it live."""
        return self.leases.acquire(session_id)

    def renew(self, session_id: str) -> Lease:
        """Extend our lease (LockedError if it was lost: another host took it after expiry)."""
        return self.leases.renew(session_id)

    def release(self, session_id: str) -> Lease | None:
        """Give the session up (None: a lease that never pointed at a bundle was deleted)."""
        return self.leases.release(session_id)

    def list(self) -> list[Lease]:
        """Every session the remote knows (from the lease objects)."""
        return self.leases.list()

    # --- sessions ----------------------------------------------------------------------------
    def push(self, session_id: str, *, release: bool = True) -> tuple[MigrateResult, Lease]:
        """Upload the session's last commit as a new bundle and point the lease at it.

        The session must be suspended here (no live writer) when ``release``: the local writer
        lock is held for the whole push so nothing starts generating meanwhile. The push landed
        once the pointer write is accepted; superseded bundles are deleted after it.
        """
        cur = self.lease(session_id)
        fresh = cur is None or (cur.bundle is None and not cur.live())
        if not fresh and cur is not None and (cur.owner != self.host_id or cur.released):
            self.leases.held(session_id)  # raises with the holder's name
        guard = WriterLock(self.store.kv_path(session_id)) if release else None
        if guard is not None:
            guard.acquire()  # LockedError: the session is live in this host; suspend it first
        try:
            # the fleet has no bundle and nobody holds the id live: this host creates it
            held = self.acquire(session_id) if fresh else self.renew(session_id)
            name, key = self.bundles.new_key(session_id, held)
            try:
                with self.objects.failing(f"push (uploading bundle {name})", session_id), \
                        open_sink(self.objects.url_of(key), overwrite=True,  # a fresh random key: no existence check
                                  storage_options=self.storage_options) as (sink, _):
                    result = export_session(self.store, session_id, sink, compression=self.compression)
                out = self.leases.write(held.updated(bundle=key, bundle_tokens=result.tokens, released=release),
                                        expect=held, what=f"push (pointing the lease at bundle {name})")
            except BaseException:
                self.bundles.discard(session_id, key)
                raise
        finally:
            if guard is not None:
                guard.release()
        self.bundles.sweep(session_id, out)
        log.info("remote.push", id=session_id, host=self.host_id, key=key, tokens=result.tokens,
                 released=release)
        return result, out

    def pull(self, session_id: str, *, replace: bool = False,
             model: str | os.PathLike[str] | None = None) -> tuple[MigrateResult, Lease]:
        """Take the lease and import the bundle it points at; the lease stays ours."""
        cur = self.lease(session_id)
        if cur is not None and cur.live() and cur.owner != self.host_id:
            raise HeldElsewhereError(cur)
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
            with self.objects.failing(f"pull (downloading bundle {held.bundle.rsplit('/', 1)[-1]})",
                                      session_id), \
                    open_source(self.objects.url_of(held.bundle), storage_options=self.storage_options) as src:
                result = import_bundle(self.store, src, source_name=self.objects.url_of(held.bundle),
                                       replace=replace, model=model)
        except BaseException:
            try:  # hand the session back as it was: released, same bundle
                self.leases.write(held.updated(released=True), expect=held, what="giving the lease back")
            except ColiError as exc:
                log.info("lease.giveback_failed", id=session_id, error=str(exc))
            raise
        log.info("remote.pull", id=session_id, host=self.host_id, key=held.bundle,
                 tokens=result.tokens)
        return result, held

    def resume(self, session_id: str, model_source: str | os.PathLike[str] | None = None,
               options: SessionOptions = DEFAULT_SESSION_OPTIONS) -> Any:
        """Open the session live on this host: pull it unless this host already holds it (or
        the fleet has no bundle of it and the local copy is the only one).

        While it stays resident a :class:`LeaseKeeper` renews the lease every
        ``renew_interval`` s and fences its commits (LockedError once the lease is lost)."""
        cur = self.lease(session_id)
        if cur is not None and cur.live() and cur.owner != self.host_id:
            raise HeldElsewhereError(cur)
        local = self.store.exists(session_id)
        if cur is not None and cur.owner == self.host_id and not cur.released and local:
            held = self.renew(session_id)
        elif (cur is None or cur.bundle is None) and local:
            held = self.acquire(session_id)
        else:
            _, held = self.pull(session_id, replace=True)
        return self._keep(self.store.open(session_id, model_source, options), held)

    def begin_turn(self, session_id: str, open_local: Callable[[], tuple[Any, bool]],
                   model_source: str | os.PathLike[str] | None = None,
                   options: SessionOptions = DEFAULT_SESSION_OPTIONS) -> tuple[Any, bool]:
        """(session, created) for one turn through the fleet, its lease held and kept.

        A session the fleet has a bundle of is resumed (:meth:`resume`). Otherwise this host
        takes the lease FIRST (a conditional create: of two hosts creating the same id one
        wins, the other is refused as held by the winner), then ``open_local`` opens its own
        copy or creates the session; a failure there deletes the lease again."""
        cur = self.lease(session_id)
        if cur is not None and cur.bundle is not None:
            return self.resume(session_id, model_source, options), False
        held = self.acquire(session_id)
        if held.bundle is not None:  # another host pushed it meanwhile: continue from its bundle
            _, held = self.pull(session_id, replace=True)
            return self._keep(self.store.open(session_id, model_source, options),
                              held), False
        try:
            session, created = open_local()
        except BaseException:
            try:
                self.leases.forget(held)
            except ColiError as exc:
                log.info("lease.forget_failed", id=session_id, error=str(exc))
            raise
        return self._keep(session, held), created

    def _keep(self, session: Any, held: Lease) -> Any:
        session.commits.guard_with(LeaseKeeper(self, held.session_id, held,
                                               interval=self.renew_interval).start())
        return session


__all__ = ["RemoteStore"]
