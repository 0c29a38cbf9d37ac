"""This server as one host of a fleet sharing an object store (``serve --http --remote
s3://bucket/prefix``, FORMAT.md 6.4 and 7): the fleet, not the local store, is every session's home.

:class:`FleetHome` is what the engine asks before and after a session lives here:

- :meth:`FleetHome.check_out` before a session that is not resident opens: refused (409
  ``session_held``, naming the holder) while another host holds its lease live; otherwise the
  lease is taken and, unless the local copy is known to equal the fleet's current bundle, that
  bundle is pulled over it. A session the fleet has no bundle of is created or continued here
  under a conditional create of its lease (of two hosts creating one id, one wins).
- :meth:`FleetHome.session_options` as it opens: with ``--ship-every-commit``, the commit runner
  it opens with ships each commit a turn makes (wrapped around the engine's runner then, never
  swapped into a live session).
- :meth:`FleetHome.keep` once it is open: a LeaseKeeper renews the lease while it stays
  resident and fences its commits (a lost lease: every further commit is refused).
- :meth:`FleetHome.check_in` after it was suspended, evicted or closed: push a new bundle and
  release the lease. A failed push keeps the local commit and the lease as it was; the next
  check-in (at the latest the server's shutdown, :meth:`FleetHome.close`) pushes again.
- :meth:`FleetHome.forget` before a session is deleted here: it is deleted from the fleet too.

A resident session whose lease was lost (another host took it over after it expired, or the
store stayed unreachable past the TTL) is dropped uncommitted at its next request, which then
checks the session out afresh: 409 while the new owner holds it live, 503 while the store cannot
be reached, else the fleet's copy is pulled (never pushed over). Every method runs as a job
on the engine loop, one at a time; the listing (:meth:`FleetHome.listing`) may run beside.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from kernels.errors import ColiError, LockedError
from sessionstore.log import get_logger
from sessionstore.migration import HeldElsewhereError, Lease, LeaseKeeper, RemoteStore, RemoteStoreError, TurnShipper
from sessionstore.service.errors import ApiError
from sessionstore.sessions import Session, SessionOptions, is_offloaded

log = get_logger("fleet")


class FleetHome:
    """The fleet's side of this server's sessions: leases held, bundles pushed and pulled."""

    def __init__(self, remote: RemoteStore, *, model: str | None = None, ship: bool = True,
                 ship_every_commit: bool = False) -> None:
        self.remote = remote
        self.shipper = TurnShipper(remote) if ship else None  # write-through shipping (FORMAT.md 6.7)
        self.ship_every_commit = ship and ship_every_commit  # also at each commit inside a turn
        self.model = model  # pulls refuse bundles of another model
        self._held: dict[str, Lease] = {}  # checked out here, not pushed back yet
        self._kept: dict[str, tuple[Session, LeaseKeeper]] = {}  # resident here, lease renewed
        self._synced: dict[str, str] = {}  # bundle key the local copy equals (pushed or pulled)
        self.push_errors: dict[str, str] = {}  # the last failed check-in of a session

    @property
    def host_id(self) -> str:
        return self.remote.host_id

    @property
    def url(self) -> str:
        return self.remote.url

    def probe(self) -> None:
        """Fail now, in one line, when the store or its bucket cannot be reached."""
        objects = self.remote.objects
        with objects.failing("checking the bucket", None):
            objects.call("list_objects_v2", Prefix=objects.key("leases") + "/", MaxKeys=1)

    # ---- before and after a session lives here ----------------------------------------------
    def check_out(self, session_id: str, *, create: bool) -> bool:
        """Hold ``session_id``'s lease before the engine opens it; True when the fleet's copy
        was pulled over the local one (the engine must open it afresh). A session that is
        resident here with its lease kept passes at once (no request to the store)."""
        kept = self._kept.pop(session_id, None)
        if kept is not None:
            session, keeper = kept
            if session.state == "resident" and keeper.lost is None:
                self._kept[session_id] = kept
                return False
            if session.state == "resident":  # lost: what it staged must never be committed
                log.warning("fleet.lease_lost", id=session_id, host=self.host_id, why=keeper.lost)
                session.abandon()
            self._held.pop(session_id, None)
        with self._refusals(session_id):
            return self._take(session_id, create)

    def _take(self, session_id: str, create: bool) -> bool:
        remote = self.remote
        cur = remote.lease(session_id)
        if cur is not None and cur.live() and cur.owner != self.host_id:
            raise HeldElsewhereError(cur)
        # an offloaded stub (FORMAT.md 5.10) is no local copy: the fleet's bundle is pulled over it
        local = remote.store.exists(session_id) and not is_offloaded(remote.store.session_dir(session_id))
        if cur is not None and cur.owner == self.host_id and not cur.released and local:
            self._held[session_id] = remote.renew(session_id)  # still ours: the local copy is newest
            return False
        if (cur is None or cur.bundle is None) and not local and not create:
            return False  # nowhere: the engine answers 404
        held = remote.acquire(session_id)  # a conditional write: one host wins
        if self.shipper is not None and self.shipper.take_over(  # a shipped chain past the bundle: fetched
                session_id, held, local_current=local, model=self.model):
            self._held[session_id] = held
            self._synced.pop(session_id, None)
            return True
        if held.bundle is None or (local and self._synced.get(session_id) == held.bundle):
            self._held[session_id] = held
            if held.bundle is not None:
                self._chain_from(held)
            return False
        try:
            _, held = remote.pull(session_id, replace=True, model=self.model)
        except BaseException:
            self._synced.pop(session_id, None)
            raise
        assert held.bundle is not None
        self._held[session_id], self._synced[session_id] = held, held.bundle
        self._chain_from(held)
        log.info("fleet.pulled", id=session_id, host=self.host_id, bundle=held.bundle)
        return True

    def _chain_from(self, held: Lease) -> None:
        """The local copy equals the lease's bundle: the turns shipped next extend it."""
        if self.shipper is not None:
            self.shipper.start_from(held.session_id, held, self.remote.store.snapshot(held.session_id).epoch)

    def turn_done(self, session_id: str) -> None:
        """A turn on ``session_id`` committed: ship what it added (FORMAT.md 6.7) before its answer's
        final event. 503 when the store fails; 409 once another host claimed the chain (fenced)."""
        held = self._held.get(session_id)
        if self.shipper is None or held is None:
            return
        with self._refusals(session_id):
            self.shipper.ship(session_id, held)

    def session_options(self, session_id: str, options: SessionOptions) -> SessionOptions:
        """The options ``session_id`` opens with: ``options``, and with ``--ship-every-commit`` a
        commit runner around theirs that ships each commit a turn makes, once it has returned
        (a failure there is logged; the turn's end ships, or refuses, again)."""
        if not self.ship_every_commit:
            return options
        inner = options.commit_runner

        def runner(commit: Callable[[], object], *, overlap: bool = False) -> None:
            def finish_and_ship() -> object:
                count = commit()
                try:
                    self.turn_done(session_id)  # nothing while this host does not hold its lease
                except (ApiError, ColiError) as exc:
                    log.warning("fleet.ship_failed", id=session_id, host=self.host_id, error=str(exc))
                return count
            if inner is None:
                finish_and_ship()
            else:
                inner(finish_and_ship, overlap=overlap)

        return replace(options, commit_runner=runner)

    def keep(self, session: Session) -> None:
        """Renew the lease of ``session`` (open and resident now) until it is released, and
        refuse its commits once the lease is lost."""
        kept = self._kept.get(session.id)
        if kept is not None and kept[0] is session and session.state == "resident":
            return
        held = self._held.get(session.id)
        if held is None or session.state != "resident":
            return
        keeper = LeaseKeeper(self.remote, session.id, held, interval=self.remote.renew_interval).start()
        session.commits.guard_with(keeper)  # released with the session (session_resume.release_files)
        self._kept[session.id] = (session, keeper)

    def check_in(self, session_id: str) -> None:
        """Push the (suspended) session as a new bundle and release its lease. Never raises:
        a failure is logged and kept in :attr:`push_errors`; the lease stays as it was."""
        self._kept.pop(session_id, None)
        if session_id not in self._held:
            return
        try:
            _, lease = self.remote.push(session_id, release=True)
        except ColiError as exc:
            self.push_errors[session_id] = str(exc)
            log.warning("fleet.push_failed", id=session_id, host=self.host_id, error=str(exc))
            if isinstance(exc, LockedError):  # another host owns it now: its history is the fleet's
                self._held.pop(session_id, None)
                self._synced.pop(session_id, None)
            return
        self._held.pop(session_id, None)
        self.push_errors.pop(session_id, None)
        if lease.bundle is not None:
            self._synced[session_id] = lease.bundle
        if self.shipper is not None:  # the chain extended the old pointer: stale now, deleted
            self.shipper.pushed(session_id, lease)

    def shipped(self, session_id: str, lease: Lease) -> None:
        """The caller pushed the (suspended) session and released it (``lease``, the store's
        answer): this host no longer holds it, and its local copy equals that bundle."""
        self._kept.pop(session_id, None)
        self._held.pop(session_id, None)
        self.push_errors.pop(session_id, None)
        if lease.bundle is not None:
            self._synced[session_id] = lease.bundle
        if self.shipper is not None:
            self.shipper.pushed(session_id, lease)

    def close(self) -> None:
        """Check in every session still checked out (the server stops)."""
        for session_id in list(self._held):
            self.check_in(session_id)
        if self.shipper is not None:
            self.shipper.close()  # background compactions finish (or are left: the chains stay whole)

    def forget(self, session_id: str) -> bool:
        """Delete the session from the fleet (its lease, then its bundles) before it is deleted
        here; 409 while another host holds it live. False: the fleet never had it."""
        self._kept.pop(session_id, None)
        self._held.pop(session_id, None)
        self._synced.pop(session_id, None)
        self.push_errors.pop(session_id, None)
        with self._refusals(session_id):
            cur = self.remote.lease(session_id)
            if cur is None:
                return False
            if cur.live() and cur.owner != self.host_id:
                raise HeldElsewhereError(cur)
            if cur.bundle is None:
                self.remote.release(session_id)  # a bundle-less lease is deleted
                if self.shipper is not None:  # with the chain its turns were shipped as
                    self.shipper.forget(session_id)
                return True
            self.remote.leases.forget(cur)  # conditional (If-Match): a lease changed meanwhile stays
            self.remote.bundles.sweep(session_id, cur.updated(bundle=None))  # every bundle up to it
            if self.shipper is not None:
                self.shipper.forget(session_id)
        log.info("fleet.deleted", id=session_id, host=self.host_id)
        return True

    # ---- what handlers may read -------------------------------------------------------------
    def state(self, session_id: str) -> dict[str, Any]:
        """This host's view of the session in the fleet (no request to the store)."""
        out: dict[str, Any] = {"host": self.host_id, "held": session_id in self._held}
        if session_id in self.push_errors:
            out["push_error"] = self.push_errors[session_id]
        return out

    def listing(self, local: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``local`` (the local sessions' descriptions) with the fleet's sessions: one whose
        local copy is not known to be current (another host's newer bundle, or held live
        elsewhere) is listed as the fleet has it, state ``remote``, and so is one not here
        (pushed, or being created live on another host)."""
        with self._refusals(None):
            leases = {lease.session_id: lease for lease in self.remote.list()
                      if lease.bundle is not None or self._elsewhere(lease)}  # pushed, or live elsewhere
        out = []
        for desc in local:
            lease = leases.get(desc["id"])
            if lease is None or desc["id"] in self._held or (
                    self._synced.get(desc["id"]) == lease.bundle and not self._elsewhere(lease)) or (
                    self._offloaded_as(desc, lease) and not self._elsewhere(lease)):
                leases.pop(desc["id"], None)
                out.append({**desc, "fleet": self.state(desc["id"])})
        out += [self._describe(lease) for lease in leases.values()]
        return sorted(out, key=lambda d: str(d["id"]))

    @staticmethod
    def _offloaded_as(desc: dict[str, Any], lease: Lease) -> bool:
        """Whether ``desc`` is an offloaded stub of the lease's current bundle (FORMAT.md 5.10)."""
        return desc.get("state") == "offloaded" and lease.bundle is not None and \
            str(desc.get("location", "")).endswith("/" + lease.bundle)

    def _elsewhere(self, lease: Lease) -> bool:
        return lease.live() and lease.owner != self.host_id

    def _describe(self, lease: Lease) -> dict[str, Any]:
        return {"id": lease.session_id, "object": "session", "tokens": lease.bundle_tokens,
                "committed": lease.bundle_tokens, "state": "remote", "last_use": lease.updated_utc,
                "fleet": {"host": self.host_id, "held": False,
                          "holder": lease.owner if self._elsewhere(lease) else None,
                          "generation": lease.generation}}

    @contextmanager
    def _refusals(self, session_id: str | None) -> Iterator[None]:
        """The fleet's refusals as API errors: held elsewhere 409 (or, when the holder said where it
        serves, the error itself, which the route answers with a 307 there), the store failing 503."""
        try:
            yield
        except HeldElsewhereError as exc:
            if exc.holder_url is not None:
                raise
            raise ApiError(409, str(exc), code="session_held") from None
        except LockedError as exc:
            raise ApiError(409, str(exc), code="session_held") from None
        except RemoteStoreError as exc:
            raise ApiError(503, str(exc), code="fleet_unavailable") from None


__all__ = ["FleetHome"]
