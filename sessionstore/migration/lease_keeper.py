"""Keep a live session's lease on the object-store tier while this host generates with it.

A lease lives ``ttl`` seconds (``RemoteStore.lease_ttl``). A conversation that stays resident
longer would otherwise lose it silently: another host could take the session over while this one
still commits. :class:`LeaseKeeper` renews the lease on a daemon thread every ``interval``
(``ttl / 3`` by default) and fences this host's commits: once the lease is lost (another host
took it over, or renewals kept failing until it expired), :meth:`check`, which
:meth:`Session.commit` calls before every commit, raises :class:`LockedError`, so nothing more is
committed here. A push is fenced on its own (its conditional write fails).

An outage of the store (any failure but a LockedError: connection refused, botocore or aiohttp
errors, a missing bucket) does not lose the lease: renewals go on with a backoff (from
``RETRY_FIRST_S``, doubling, at most ``interval`` apart and never past half the time left) until
one succeeds or the lease would have expired (FORMAT.md 6.4).
"""
from __future__ import annotations

import threading
import time
from typing import Protocol

from kernels.errors import LockedError
from sessionstore.log import get_logger
from sessionstore.migration.lease import Lease

log = get_logger("lease")

RETRY_FIRST_S = 0.25


class LeaseRenewer(Protocol):
    """What a keeper needs of the object-store tier (``RemoteStore`` is one)."""

    @property
    def host_id(self) -> str: ...

    @property
    def lease_ttl(self) -> float: ...

    def renew(self, session_id: str) -> Lease:
        """Extend this host's lease; LockedError once it was lost."""
        ...


class LeaseKeeper:
    """Renews ``session_id``'s lease for this host until :meth:`stop`; see the module doc."""

    def __init__(self, remote: LeaseRenewer, session_id: str, lease: Lease, *,
                 interval: float | None = None) -> None:
        self.remote = remote
        self.session_id = session_id
        self.interval = float(interval) if interval is not None else remote.lease_ttl / 3
        self.renewals = 0
        self._expires_at = lease.expires_at
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"coli-lease-{session_id}",
                                        daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    @property
    def lost(self) -> str | None:
        """Why the lease is no longer ours (None while it is)."""
        if self._lost is None and time.time() >= self._expires_at:
            self._lost = "it expired before a renewal succeeded"
        return self._lost

    def check(self) -> None:
        """Raise LockedError once the lease is lost: the caller must not commit."""
        why = self.lost
        if why is not None:
            raise LockedError(f"session {self.session_id!r}: this host "
                              f"({self.remote.host_id}) no longer holds its lease ({why}); "
                              "nothing more is committed here")

    def stop(self) -> None:
        """Stop renewing (the lease stays as it is: released by a push, or left to expire)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 30)

    def _run(self) -> None:
        delay, failures = self.interval, 0
        while not self._stop.wait(delay):
            try:
                lease = self.remote.renew(self.session_id)
            except LockedError as exc:
                self._lost = str(exc)
                log.info("lease.lost", id=self.session_id, host=self.remote.host_id, error=str(exc))
                return
            except Exception as exc:  # the store failing in any way: retry until expiry
                if self.lost is not None:
                    self._lost = f"{self._lost} (last renewal error: {_line(exc)})"
                    log.info("lease.lost", id=self.session_id, host=self.remote.host_id,
                             error=self._lost)
                    return
                failures += 1
                left = self._expires_at - time.time()
                delay = max(0.01, min(self.interval, RETRY_FIRST_S * 2 ** (failures - 1), left / 2))
                log.info("lease.renew_failed", id=self.session_id, error=_line(exc),
                         failures=failures, retry_in_s=round(delay, 2), expires_in_s=round(left, 1))
                continue
            delay, failures = self.interval, 0
            self._expires_at = lease.expires_at
            self.renewals += 1
            log.info("lease.renew", id=self.session_id, generation=lease.generation,
                     expires_at=lease.expires_at)


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


__all__ = ["LeaseKeeper", "LeaseRenewer"]
