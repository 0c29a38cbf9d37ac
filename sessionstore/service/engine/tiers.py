"""The store's tiers while serving (FORMAT.md 5.10, README "serve"): resident, local disk, object
store. :class:`TierManager` acts on the plan of :mod:`sessionstore.sessions.tier_policy`:

- before a turn on a session (``--max-disk-bytes B``): room for what the turn may add (its prompt
  and ``max_tokens`` as records, plus the writer's headroom) is made by offloading the least
  recently used idle sessions (``--remote``), else the turn is refused with 507 before anything is
  written; an offloaded session is restored first (the fleet's bundle pulled over its stub);
- offloading a session: it is closed here, shipped (pushed unless the fleet's bundle already is
  this copy), the bundle verified in the object store (the lease re-read points at it, the object
  is there and not empty), then its tier record marks it offloaded and its kv file and the rest of
  its data are removed (the manifest, its commit state page and the tier record stay: a stub);
- expiry: a session past its ``retention_seconds`` is deleted here and from the object store;
- a request's ``retention_seconds`` / ``pinned`` (or ``PATCH /v1/sessions/{id}``) are written to
  the tier record.

Every method runs as a job on the engine loop (a turn's, or the sweeper's work); a session
another request holds is skipped (:meth:`Engine.claim`). :class:`Sweeper` runs :meth:`sweep`
every ``interval`` seconds.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from typing import Any

from kernels.errors import ColiError
from kernels.rows import KV_FORMAT_OF_DTYPE
from sessionstore.kvfile import (
    HEADER_SIZE,
    PAGE,
    Dims,
    WriterLock,
    default_headroom,
    fsync_directory,
    record_bytes,
    sidecar_bound,
)
from sessionstore.log import get_logger
from sessionstore.service.engine.tier_metrics import TierMetrics
from sessionstore.service.engine.turns import Admitted
from sessionstore.service.errors import ApiError
from sessionstore.service.wire import DEFAULT_SWEEP_INTERVAL_S, TurnSpec
from sessionstore.sessions import (
    KV_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    SIDECAR_NAME,
    STATE_BYTES,
    STATE_SLOTS,
    TIER_NAME,
    Offloaded,
    SessionUse,
    TierChange,
    TierPlan,
    TierRecord,
    epoch_of,
    plan_tiers,
    read_tier,
    session_disk_bytes,
    state_path,
    utc_now,
    write_tier,
)

STUB_NAMES = frozenset({MANIFEST_NAME, MANIFEST_NAME + ".state", TIER_NAME, LOCK_NAME})  # what an offload keeps
MAX_ROUNDS = 8  # plans a turn's room is made in (each round skips what the one before could not move)

log = get_logger("tiers")
NEW_SESSION_SMALL_FILES = STATE_SLOTS * STATE_BYTES + 2 * PAGE  # a new session's commit state page
# file (both slots) and a bound of its manifest and lock file, which a turn's bound counts before they exist


class TierManager:
    """The engine's tiers: the disk budget, offload and restore, retention (see the module)."""

    def __init__(self, engine: Any, *, max_disk_bytes: int | None = None) -> None:
        self.engine = engine
        self.store = engine.store
        self.home = engine.home  # fleet.FleetHome (serve --remote), else None: nothing is offloaded
        self.budget = max_disk_bytes
        self.metrics = TierMetrics(engine.metrics.registry)
        self.metrics.bind(self.store.residency.resident_bytes, self.store.catalogue.bytes_by_state)
        self._reserved: dict[str, int] = {}  # session -> its kv file's size bound while its turn runs

    # ---- a turn's hooks (its job on the loop) --------------------------------------------------
    def before_turn(self, spec: TurnSpec, admitted: Admitted) -> None:
        """Make room on the disk for the turn on ``spec.session`` (507 when it cannot be made)
        and restore the session when it is offloaded; ``admitted``: its prompt, checked."""
        sid = spec.session
        if sid is None:
            return
        exists = self.store.exists(sid)
        record = read_tier(self.store.session_dir(sid)) if exists else TierRecord()
        if self.budget is not None:
            needed, bound = self.turn_need(admitted, sid, record)
            self.make_room(needed, keep=sid)
            self._reserved[sid] = bound  # counted for the session until the turn ends (after_turn)
        if record.offloaded is not None:
            self.restore(sid, record)

    def after_turn(self, spec: TurnSpec) -> None:
        """The turn on ``spec.session`` ended: its file's size is counted as it is again."""
        if spec.session is not None:
            self._reserved.pop(spec.session, None)

    def after_open(self, spec: TurnSpec) -> None:
        """Write the request's ``retention_seconds`` / ``pinned`` to the session's tier record."""
        change = getattr(spec, "tier", None)
        if spec.session is not None and change:
            self.change(spec.session, change)

    # ---- the disk budget --------------------------------------------------------------------------
    def turn_need(self, admitted: Admitted, sid: str, record: TierRecord) -> tuple[int, int]:
        """(bytes the turn may add to this disk, the bound of the session's files during it): the
        kv file's and sidecar's sizes after a turn of the prompt's tokens and ``max_tokens`` new
        ones (an upper bound: records never pass prompt + new; plus the writers' headroom), its
        other files at their size now, less the session's size now (an offloaded one's is 0 here)."""
        prompt, max_new = admitted.ids, admitted.max_new
        now_bytes, others, per_record = 0, 0, self._record_bytes_of(sid)
        if record.offloaded is None and self.store.exists(sid):
            d = self.store.session_dir(sid)
            now_bytes = session_disk_bytes(d)
            others = now_bytes - sum(os.lstat(d / n).st_size for n in (KV_NAME, SIDECAR_NAME) if os.path.lexists(d / n))
            state = state_path(d / MANIFEST_NAME)  # a one-slot page file grows to both slots when opened
            others += max(0, STATE_SLOTS * STATE_BYTES - (os.lstat(state).st_size if os.path.lexists(state) else 0))
        elif record.offloaded is None:  # a new session: the small files it installs (FORMAT.md 5.1)
            others = NEW_SESSION_SMALL_FILES
        # the writer's headroom ends on a page boundary (FORMAT.md 3.4.1): one page more bounds it
        records = len(prompt) + max_new
        after = HEADER_SIZE + records * per_record + default_headroom(per_record) + PAGE
        after += sidecar_bound(records) + others
        if record.offloaded is not None:
            after = max(after, record.offloaded.bytes)  # it comes back whole first
        return max(0, after - now_bytes), max(after, now_bytes)

    def _record_bytes_of(self, sid: str) -> int:
        """One record's bytes in the session's kv file (FORMAT.md 1.1): its manifest's dims and
        kv dtype (an offloaded stub keeps its manifest), a new session's the model's and the
        server's ``--kv``."""
        if self.store.exists(sid):
            manifest = self.store.read_manifest(sid)
            dims, kv_dtype = Dims(**manifest.dims), manifest.kv_dtype
        else:
            dims, kv_dtype = Dims(*self.engine.model.dims_for_file()), self.engine.kv_dtype
        version, tag = KV_FORMAT_OF_DTYPE[kv_dtype]
        return record_bytes(version, dims, tag)

    def _drop_stale_reservations(self, keep: str | None) -> None:
        for sid in [sid for sid in self._reserved if sid != keep]:
            if self._idle(sid):  # its turn never opened it (refused): no turn holds the bound any more
                del self._reserved[sid]

    def uses(self, keep: str | None = None) -> list[SessionUse]:
        """Every listed session as the policy reads it (``keep``: busy, never moved): a full scan
        of the catalogue, for plans that move sessions (not for a turn that fits)."""
        self._drop_stale_reservations(keep)
        out = []
        recent = self.engine.last_use
        unlisted = dict(self._reserved)  # running turns' sessions without a row yet (new ones)
        for e in self.store.catalogue.entries():
            if e.state in ("missing", "unreadable"):
                continue
            last = max(epoch_of(e.last_use), recent.get(e.id, 0.0))
            reserved = unlisted.pop(e.id, None)
            size = e.bytes if reserved is None else max(e.bytes, reserved)
            out.append(SessionUse(e.id, size, last, e.retention_s, e.pinned,
                                  e.state == "offloaded" and reserved is None,  # a running turn restores it
                                  busy=e.id == keep or reserved is not None))
        # a plan counts what local_bytes counts: a new session's bound before its row exists (left out, two
        # new sessions' turns were each planned as if the other's bytes were not there: five 214 KB sessions
        # on a 1,000,000-byte disk)
        out += [SessionUse(sid, bound, time.time(), busy=True) for sid, bound in unlisted.items()]
        return out

    def local_bytes(self, keep: str | None = None) -> int:
        """The local sessions' bytes as the catalogue has them, a running turn's at its bound: the
        catalogue's running totals, plus each reservation over its row (O(running turns))."""
        self._drop_stale_reservations(keep)
        by_state = self.store.catalogue.bytes_by_state()
        total = by_state.get("resident", 0) + by_state.get("suspended", 0)
        for sid, bound in self._reserved.items():
            row = self.store.catalogue.get(sid)
            listed = row.bytes if row is not None and row.state in ("resident", "suspended") else 0
            total += max(0, bound - listed)  # max(row bytes, bound); without a local row (a new session
            # before its row, an offloaded one coming back) the whole bound: never less than a plan counts
        return total

    def make_room(self, needed: int, *, keep: str) -> None:
        """Expire what is due and offload until ``needed`` more bytes fit the budget; 507 (and
        nothing moved) when no plan fits, or when offloading fell short."""
        assert self.budget is not None
        if self.local_bytes(keep) + needed <= self.budget:  # it fits as it is: no plan, no scan
            return  # (sessions past their retention are the sweeper's then)
        stuck: set[str] = set()  # sessions an offload or expiry skipped (a request holds them): planned without
        for _ in range(MAX_ROUNDS):
            uses = [replace(u, busy=True) if u.id in stuck else u for u in self.uses(keep)]
            plan = plan_tiers(uses, now=time.time(), budget=self.budget, needed=needed,
                              can_offload=self.home is not None)
            if not plan.fits:
                break
            if not plan.expire and not plan.offload:
                return
            stuck.update(self.act(plan))
        raise self._full(needed)

    def _full(self, needed: int) -> ApiError:
        used = self.local_bytes()
        how = ("even with every idle, unpinned session offloaded" if self.home is not None
               else "and this server has no --remote to offload sessions to")
        return ApiError(507, f"this turn may add {needed} bytes to the store's disk, which holds {used} of its "
                        f"--max-disk-bytes {self.budget} {how}; nothing was written: delete or unpin sessions, or "
                        "ask for fewer max_tokens", code="insufficient_storage")

    def act(self, plan: TierPlan) -> list[str]:
        """Expire, then offload, as ``plan`` says; the sessions skipped."""
        skipped = [sid for sid in plan.expire if not self.expire(sid)]
        return skipped + [sid for sid in plan.offload if not self.offload(sid)]

    def sweep(self) -> TierPlan:
        """Expire what is due; offload what passes the budget (the sweeper's work)."""
        plan = plan_tiers(self.uses(), now=time.time(), budget=self.budget, can_offload=self.home is not None)
        self.act(plan)
        return plan

    # ---- one session ------------------------------------------------------------------------------
    def _idle(self, sid: str) -> bool:
        """Whether no request holds ``sid`` now. It is not kept claimed: this runs as a job on the
        engine loop, so a request that claims it meanwhile runs after this (and restores it),
        never beside it, and is never refused for it."""
        try:
            self.engine.claim(sid)
        except ApiError:
            return False  # a request holds it: left for the next sweep
        self.engine.release(sid)
        return True

    def offload(self, sid: str) -> bool:
        """Ship, verify, then remove the local data of ``sid`` (False: skipped, and why logged)."""
        if self.home is None or not self._idle(sid):
            return False
        try:
            return self._offload(sid)
        except (ColiError, ApiError, OSError) as exc:
            log.warning("tiers.offload_failed", id=sid, error=str(exc))
            return False

    def _offload(self, sid: str) -> bool:
        home, remote, store = self.home, self.home.remote, self.store
        d = store.session_dir(sid)
        record = read_tier(d)
        if record.pinned or record.offloaded is not None:
            return False
        self.engine.forget(sid)  # closed here (committed, lock released)
        home.check_in(sid)  # pushed and released when it was checked out here
        if sid in home.push_errors:
            return False
        manifest = store.read_manifest(sid)
        cur = remote.lease(sid)
        if cur is not None and cur.live() and cur.owner != remote.host_id:
            log.info("tiers.offload_skipped", id=sid, reason=f"held live by {cur.owner}")
            return False
        if (cur is None or cur.bundle is None or not cur.released
                or (cur.owner == remote.host_id and cur.bundle_tokens != manifest.committed)):
            if cur is not None and cur.released:
                remote.acquire(sid)  # a released lease is taken back before this copy goes over it
            _, cur = remote.push(sid, release=True)
            home.shipped(sid, cur)
        bundle = self._verified(sid, cur.bundle)
        size = sum(os.lstat(d / n).st_size for n in os.listdir(d) if n not in STUB_NAMES and not n.startswith("."))
        mark = Offloaded(remote.url, bundle, size, cur.bundle_tokens, utc_now())
        with WriterLock(store.kv_path(sid)), store.catalogue.changing(sid):
            write_tier(d, TierRecord(record.retention_seconds, record.pinned, mark))  # first: the stub says where
            for name in sorted(os.listdir(d)):
                if name not in STUB_NAMES and not name.startswith("."):
                    os.unlink(d / name)
            fsync_directory(d)
        self.engine.last_use.pop(sid, None)
        self.metrics.offloads.inc()
        log.info("tiers.offloaded", id=sid, bundle=bundle, bytes=size, tokens=cur.bundle_tokens)
        return True

    def _verified(self, sid: str, bundle: str | None) -> str:
        """``bundle`` once the store shows it: the lease read again points at it and the object is
        there, not empty (else ColiError: the local files stay)."""
        remote = self.home.remote
        again = remote.lease(sid)
        if bundle is None or again is None or again.bundle != bundle:
            raise ColiError(f"session {sid!r}: the fleet's lease does not point at the bundle shipped")
        with remote.objects.failing("verifying the shipped bundle", sid):
            head = remote.objects.call("head_object", Key=bundle)
        if int(head.get("ContentLength", 0)) <= 0:
            raise ColiError(f"session {sid!r}: the shipped bundle is empty in the object store")
        return bundle

    def restore(self, sid: str, record: TierRecord) -> None:
        """Pull the fleet's bundle of the offloaded ``sid`` over its stub; its tier record again."""
        assert record.offloaded is not None
        if self.home is None:
            raise ApiError(409, f"session {sid!r} is offloaded to the object store {record.offloaded.url}; this "
                           "server has no --remote to restore it from", code="session_offloaded")
        self.home.check_out(sid, create=False)
        d = self.store.session_dir(sid)
        if read_tier(d).offloaded is not None:
            raise ApiError(503, f"session {sid!r} is offloaded and the object store has no bundle of it now",
                           code="fleet_unavailable")
        restored = record.restored()
        write_tier(d, restored)
        self.store.catalogue.note_tier(sid, restored)
        self.metrics.restores.inc()
        log.info("tiers.restored", id=sid, bundle=record.offloaded.bundle)

    def expire(self, sid: str) -> bool:
        """Delete ``sid`` here and from the object store (False: skipped, and why logged)."""
        if not self._idle(sid):
            return False
        try:
            record = read_tier(self.store.session_dir(sid))
            if record.pinned:
                return False
            if record.offloaded is not None and self.home is None:
                log.warning("tiers.expire_remote_kept", id=sid, reason="offloaded, and this server has no --remote")
            self.engine.delete(sid)
        except (ColiError, ApiError, OSError) as exc:
            log.warning("tiers.expire_failed", id=sid, error=str(exc))
            return False
        self.metrics.expiries.inc()
        log.info("tiers.expired", id=sid, retention_s=record.retention_seconds)
        return True

    def change(self, sid: str, change: TierChange) -> TierRecord:
        """Apply ``change`` to the tier record of ``sid`` (which must exist here)."""
        if not self.store.exists(sid):
            raise ApiError(404, f"no session {sid!r}", code="session_not_found")
        d = self.store.session_dir(sid)
        record = change.apply(read_tier(d))
        write_tier(d, record)
        self.store.catalogue.note_tier(sid, record)
        return record


class Sweeper:
    """Runs :meth:`TierManager.sweep` as the engine's work every ``interval`` seconds until stopped."""

    def __init__(self, manager: TierManager, interval: float = DEFAULT_SWEEP_INTERVAL_S) -> None:
        if not interval > 0:
            raise ValueError(f"sweep interval {interval} s must be > 0")
        self.manager, self.interval = manager, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Sweeper:
        self._thread = threading.Thread(target=self._run, name="coli-tier-sweeper", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.run_once()

    def run_once(self) -> TierPlan | None:
        """One sweep on the engine (None when the engine refused it: stopping, or it failed)."""
        try:
            return self.manager.engine.submit(self.manager.sweep).result()  # type: ignore[no-any-return]
        except ApiError:
            return None  # the server is stopping
        except Exception as exc:  # one failed sweep is logged; the next one tries again
            log.warning("tiers.sweep_failed", error=str(exc))
            return None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


__all__ = ["Sweeper", "TierManager"]
