"""Write-through shipping (FORMAT.md 6.7): every finished turn's new records go to the object store
as one *segment* object, and the session's *head* object names the chain (base bundle + segments).

- :meth:`TurnShipper.ship` after a turn's commit: uploads records ``[chain end, committed)`` with
  their sidecar entries and the session's small files, then moves the head with a conditional
  write (``If-Match`` the head this host wrote last). A head write that loses means another host
  claimed the chain (a takeover): the segment is deleted and the chain forgotten here
  (LockedError). Cost: O(new records) plus the head (a fixed few hundred bytes: each segment
  names its predecessor, the head only the last one). A turn that cut the history (a truncate:
  regenerate, edit, a re-tokenized boundary; the manifest's epoch moved) ships a *cut* segment:
  the records from the first whose sidecar entry differs from the chain's (kept here, 8 bytes a
  record; :mod:`segment_writing`) replace the chain's from there, so a cut costs O(new records) too.
- A chain of 512 segments, or whose segments outweigh its base, is compacted in the background
  (:meth:`TurnShipper.compact` on the :class:`Compactor`'s thread; the turn's ship only asks):
  the whole commit is uploaded as a new base bundle, then the head restarts from it with a
  conditional write, or, when turns shipped meanwhile, the next ship starts its segment on it
  (amortised O(1) per shipped byte, since the base at least doubles between compactions). Only
  a chain of 1,024 segments (the most a head lists; the worker fell behind) is rebased inline.
- :meth:`TurnShipper.take_over` on a host that just took the lease: a head that extends the
  lease's bundle pointer is *claimed* (rewritten with the new generation, ``If-Match``), so the
  former holder's later head writes fail; then the chain is fetched and installed
  (:func:`chain_reader.assemble`), token-exact, never re-prefilled.
- :meth:`TurnShipper.pushed` after a whole-bundle push moved the lease pointer: the head is
  stale (it extends the old pointer) and is deleted with its segments.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from kernels.errors import ColiError, LockedError
from sessionstore.log import get_logger
from sessionstore.migration.chain_objects import ChainObjects, segment_generation, segment_name
from sessionstore.migration.chain_reader import assemble
from sessionstore.migration.compaction import Compactor, PreparedBase, compaction_due
from sessionstore.migration.exporting import ExportSource, PreparedExport, export_session
from sessionstore.migration.lease import Lease, utc_stamp
from sessionstore.migration.object_store import RemoteStoreError
from sessionstore.migration.remote import RemoteStore
from sessionstore.migration.segment_format import MAX_CHAIN_SEGMENTS, Head, SegmentRef, digest_of
from sessionstore.migration.segment_writing import ShipReport, build_segment, committed_entries, cut_point
from sessionstore.migration.transport import open_sink

log = get_logger("remote")


class TurnShipper:
    """The chains of the sessions this host ships; one call at a time (the engine loop's jobs)."""

    def __init__(self, remote: RemoteStore, *, background: bool = True) -> None:
        """``background``: compact on a :class:`Compactor` thread (else inline, in the ship that
        finds the chain due, as before the worker existed)."""
        self.remote = remote
        self.objects = remote.objects
        self.chain_objects = ChainObjects(remote.objects, remote.host_id)  # heads and segments
        self._chains: dict[str, Head] = {}  # the head as this host last wrote (or claimed) it
        self._epochs: dict[str, int] = {}  # the manifest epoch the chain's records belong to
        self._entries: dict[str, np.ndarray] = {}  # the chain's records' sidecar entries ([nrec] u64)
        self._manifests: dict[str, bytes] = {}  # the manifest.json the chain's last ship carried
        self._written: dict[str, set[str]] = {}  # segments this host added to the chain since its base
        self._prepared: dict[str, PreparedBase] = {}  # a compaction's base the next ship starts on
        self._lock = threading.RLock()  # a turn's end and a commit inside another turn may ship at once
        self.compactor = Compactor() if background else None
        self.last: dict[str, ShipReport] = {}

    def close(self) -> None:
        """Let the background compactions queued so far finish, then stop the worker."""
        if self.compactor is not None:
            self.compactor.stop()

    # ---- the chain's objects --------------------------------------------------------------------
    def read_head(self, session_id: str) -> Head | None:
        """The head as stored now (None: no chain)."""
        return self.chain_objects.read_head(session_id)

    def segment_key(self, session_id: str, name: str) -> str:
        return self.chain_objects.segment_key(session_id, name)

    # ---- a host that holds the lease ------------------------------------------------------------
    def start_from(self, session_id: str, lease: Lease, epoch: int) -> None:
        """The local copy equals the lease's bundle (just pulled or pushed): the chain starts at it."""
        if lease.bundle is None:
            return
        stored = self.read_head(session_id)
        with self._lock:  # a background compaction reads the chain too
            self._forget_chain(session_id)
            self._chains[session_id] = Head(session_id, lease.generation, self.remote.host_id, lease.bundle,
                                            lease.bundle, lease.bundle_tokens, lease.bundle_tokens,
                                            updated_utc=utc_stamp(), etag="" if stored is None else stored.etag)
            self._epochs[session_id] = epoch
            self._keep_entries(session_id, epoch, lease.bundle_tokens)

    def _keep_entries(self, session_id: str, epoch: int, nrec: int) -> None:
        """Remember the entries of the chain's records (the local copy's: it equals the chain),
        so a later cut finds where it begins; unknown ones make the next truncate a rebase."""
        entries = committed_entries(self.remote.store, session_id, epoch, nrec)
        if entries is None:
            self._entries.pop(session_id, None)
        else:
            self._entries[session_id] = entries

    def ship(self, session_id: str, lease: Lease) -> ShipReport:
        """Ship the session's last commit: a segment of the records since the chain's end (or,
        after a truncate, from the first record that differs from the chain's: a cut), or a new
        base bundle when there is no chain here, a truncate finds no known entries to cut against,
        or the chain is due for compaction; nothing when the chain already holds it. LockedError:
        fenced (another host claimed the chain)."""
        with self._lock:
            return self._ship(session_id, lease)

    def _ship(self, session_id: str, lease: Lease) -> ShipReport:
        store = self.remote.store
        snap = store.snapshot(session_id)
        chain = self._chains.get(session_id)
        rec = snap.header.record_bytes
        moved = chain is not None and self._epochs.get(session_id) != snap.epoch  # a truncate since
        if chain is None or chain.generation != lease.generation or \
                (moved and session_id not in self._entries) or (not moved and snap.committed < chain.nrec) or \
                chain.count >= MAX_CHAIN_SEGMENTS or (self.compactor is None and compaction_due(chain, rec)):
            return self._rebase(session_id, lease, snap.epoch, chain)
        source = ExportSource(snap, 4 << 20)
        try:
            if source.entries is None:  # no sidecar to ship entries from: ship the whole commit
                return self._rebase(session_id, lease, snap.epoch, chain)
            prepared = self._prepared_for(session_id, lease, snap.epoch, snap.committed, moved)
            start, n = chain.nrec if prepared is None else prepared.nrec, snap.committed
            if moved:  # a cut: the records from the first that differs from the chain's replace them
                start = cut_point(self._entries[session_id], source.entries)
            if prepared is None and n == start == chain.nrec and \
                    self._manifests.get(session_id) == source.manifest_json:
                self._epochs[session_id] = snap.epoch
                return ShipReport(session_id, "unchanged", start, n, 0, 0, 0)
            cut = prepared is None and start < chain.nrec  # a prepared base restarts the chain
            prev = chain.last if prepared is None else None  # on a prepared base: the first segment
            data, parts = build_segment(source, session_id, lease.generation, start, prev, cut=cut)
            entries = source.entries
        finally:
            source.close()
        name = segment_name(lease.generation, n)
        key = self.segment_key(session_id, name)
        with self.objects.failing(f"ship (uploading segment {name})", session_id):
            self.objects.call("put_object", Key=key, Body=data)
        ref = SegmentRef(name, start, n, len(data), digest_of(data))
        if prepared is None:
            new = replace(chain, last=ref, count=chain.count + 1, segment_bytes=chain.segment_bytes + len(data),
                          nrec=n, updated_utc=utc_stamp())
        else:
            new = Head(session_id, lease.generation, self.remote.host_id, chain.lease_bundle, prepared.key,
                       prepared.nrec, n, ref, 1, len(data), updated_utc=utc_stamp())
        try:
            written, head_bytes = self.chain_objects.write_head(new, chain, "ship (moving the head)")
        except BaseException as exc:
            self.objects.delete(key)
            if prepared is not None and isinstance(exc, LockedError):  # refused: nothing names it
                self.objects.delete(prepared.key)
            self._forget_chain(session_id)
            raise
        self._chains[session_id], self._epochs[session_id], self._entries[session_id] = written, snap.epoch, entries
        self._manifests[session_id] = bytes(parts["manifest.json"])
        if prepared is None:
            self._written.setdefault(session_id, set()).add(name)
        else:
            self._written[session_id] = {name}
            self._in_background(f"{session_id} cleanup", lambda: self._delete_replaced(chain, written))
        report = ShipReport(session_id, "cut" if cut else "segment", start, n, len(data), head_bytes,
                            (n - start) * rec)
        self.last[session_id] = report
        log.info("ship.segment", id=session_id, start=start, nrec=n, bytes=len(data), head_bytes=head_bytes,
                 on_compacted_base=prepared is not None, cut=cut)
        if self.compactor is not None and compaction_due(written, rec):
            self._in_background(session_id, lambda: self.compact(session_id, lease))
        return report

    def _in_background(self, key: str, job: Callable[[], object]) -> None:
        """Hand ``job`` to the compactor (inline when this shipper has none)."""
        if self.compactor is None:
            job()
        else:
            self.compactor.request(key, job)

    def _prepared_for(self, session_id: str, lease: Lease, epoch: int, committed: int,
                      moved: bool) -> PreparedBase | None:
        """The prepared base the next segment starts on, when it still belongs to this chain's
        lease generation and records (a truncate or a takeover since: deleted, never used)."""
        prepared = self._prepared.pop(session_id, None)
        if prepared is None:
            return None
        if not moved and prepared.generation == lease.generation and prepared.epoch == epoch and \
                prepared.nrec <= committed:
            return prepared
        self.objects.delete(prepared.key)
        return None

    # ---- background compaction (FORMAT.md 6.7.3) ---------------------------------------------------
    def compact(self, session_id: str, lease: Lease) -> str:
        """Upload the session's last commit as a whole bundle and restart the chain from it.
        Runs on the compactor's thread, never under a turn. Returns what happened:

        - ``skipped``: the chain changed hands or was replaced since it was asked for, or a base
          is already prepared; ``fenced``: this host does not hold the lease now (it never
          compacts then), or another host claimed the head first (the bundle is deleted);
        - ``compacted``: the head names the new bundle alone (If-Match the head this host wrote:
          a head it did not write is never replaced), the replaced chain deleted;
        - ``prepared``: turns shipped while it was written (or a commit is not shipped yet): the
          next ship starts its segment at the bundle's end (:class:`PreparedBase`);
        - ``dropped``: the records were truncated meanwhile; the bundle is deleted.

        The head moves last and only to a complete, uploaded bundle, so a reader (a takeover)
        always finds a whole chain; a failure or a kill before that leaves the old one."""
        with self._lock:
            chain = self._chains.get(session_id)
            if chain is None or chain.generation != lease.generation or session_id in self._prepared:
                return "skipped"
        if not self._holds(session_id, lease):
            return "fenced"
        name, key = self.remote.bundles.new_key(session_id, lease)
        with self.objects.failing(f"compaction (uploading base bundle {name})", session_id), \
                PreparedExport(self.remote.store, session_id) as export, \
                open_sink(self.objects.url_of(key), overwrite=True,
                          storage_options=self.objects.storage_options) as (sink, _):
            result = export.write(sink, compression=self.remote.compression)
            base = PreparedBase(key, result.tokens, export.snap.epoch, lease.generation)
        if not self._holds(session_id, lease):  # lost while it uploaded (the head's If-Match guards too)
            self.objects.delete(key)
            return "fenced"
        with self._lock:
            chain = self._chains.get(session_id)
            if chain is None or chain.generation != base.generation or self._epochs.get(session_id) != base.epoch:
                self.objects.delete(key)
                return "dropped"
            if chain.nrec != base.nrec:
                self._prepared[session_id] = base
                log.info("ship.compaction_prepared", id=session_id, nrec=base.nrec, chain_nrec=chain.nrec)
                return "prepared"
            new = Head(session_id, lease.generation, self.remote.host_id, chain.lease_bundle, key, base.nrec,
                       base.nrec, updated_utc=utc_stamp())
            try:
                written, _ = self.chain_objects.write_head(new, chain, "compaction (moving the head)")
            except LockedError:
                self.objects.delete(key)
                self._forget_chain(session_id)
                return "fenced"
            except BaseException:  # the store failed: the head may name it now, so it stays
                self._forget_chain(session_id)
                raise
            self._chains[session_id], self._written[session_id] = written, set()
            self._manifests.pop(session_id, None)
        log.info("ship.compacted", id=session_id, nrec=base.nrec, segments=chain.count, bytes=result.stored_bytes)
        self._delete_replaced(chain, written)
        return "compacted"

    def _holds(self, session_id: str, lease: Lease) -> bool:
        """Whether the store's lease is ``lease``'s generation, held live by this host."""
        cur = self.remote.lease(session_id)
        if cur is None or cur.owner != self.remote.host_id or cur.generation != lease.generation or not cur.live():
            log.info("ship.compaction_skipped", id=session_id, reason="this host does not hold the lease")
            return False
        return True

    def _delete_replaced(self, old: Head, new: Head) -> None:
        """Delete what the chain ``old`` held that ``new`` (restarted from a compaction's base) does
        not: its base (unless the lease's bundle) and its segments, i.e. every segment of this
        lease generation or older that this host did not add to ``new``; stops once ``new`` is no
        longer this host's chain. A later generation's segments (a takeover's) are never touched."""
        if old.base is not None and old.base not in (old.lease_bundle, new.base):
            self.objects.delete(old.base)
        try:
            for key in self.chain_objects.segment_keys(old.session_id):
                generation = segment_generation(key)
                with self._lock:
                    mine = self._chains.get(old.session_id)
                    if mine is None or (mine.base, mine.generation) != (new.base, new.generation):
                        return  # replaced again (a rebase, a takeover): that one deletes its own
                    live = key.rsplit("/", 1)[-1] in self._written.get(old.session_id, ())
                if generation is not None and generation <= new.generation and not live:
                    self.objects.delete(key)
        except Exception as exc:  # a store failure: leftovers are never read
            log.info("ship.segments_delete_failed", id=old.session_id, error=str(exc))

    def _rebase(self, session_id: str, lease: Lease, epoch: int, chain: Head | None) -> ShipReport:
        """Upload the whole commit as a new base bundle; the head restarts from it."""
        stored = chain if chain is not None and chain.generation == lease.generation else self.read_head(session_id)
        if stored is not None and stored.generation > lease.generation:
            raise LockedError(f"session {session_id!r}: its head belongs to lease generation "
                              f"{stored.generation}, this host holds {lease.generation}")
        name, key = self.remote.bundles.new_key(session_id, lease)
        with self.objects.failing(f"ship (uploading base bundle {name})", session_id), \
                open_sink(self.objects.url_of(key), overwrite=True,
                          storage_options=self.objects.storage_options) as (sink, _):
            result = export_session(self.remote.store, session_id, sink, compression=self.remote.compression)
        new = Head(session_id, lease.generation, self.remote.host_id, lease.bundle, key, result.tokens,
                   result.tokens, updated_utc=utc_stamp())
        try:
            written, head_bytes = self.chain_objects.write_head(new, stored, "ship (restarting the chain)")
        except BaseException:
            self.objects.delete(key)
            self._forget_chain(session_id)
            raise
        self._chains[session_id], self._epochs[session_id], self._written[session_id] = written, epoch, set()
        self._manifests.pop(session_id, None)
        self._keep_entries(session_id, epoch, result.tokens)
        prepared = self._prepared.pop(session_id, None)
        if prepared is not None:
            self.objects.delete(prepared.key)
        if stored is not None:
            self.chain_objects.delete_chain(stored, keep=(lease.bundle, key))
        report = ShipReport(session_id, "base", 0, result.tokens, result.stored_bytes, head_bytes, 0)
        self.last[session_id] = report
        log.info("ship.base", id=session_id, nrec=result.tokens, bytes=result.stored_bytes)
        return report

    # ---- another host's chain --------------------------------------------------------------------
    def take_over(self, session_id: str, lease: Lease, *, local_current: bool,
                  model: str | os.PathLike[str] | None = None) -> bool:
        """After this host took ``lease``: claim a head that extends its bundle pointer and install
        its chain (skipped when ``local_current``: this host wrote that very head). True when the
        chain was installed over the local copy; False: no live chain (the lease's bundle is the
        session's latest state)."""
        for _ in range(8):
            head = self.read_head(session_id)
            if head is None or head.lease_bundle != lease.bundle:
                self._forget_chain(session_id)  # stale or absent: the lease's bundle is the latest
                return False
            if head.generation > lease.generation:
                raise LockedError(f"session {session_id!r}: its head belongs to a later lease generation "
                                  f"({head.generation} > {lease.generation})")
            mine = self._chains.get(session_id)
            current = local_current and mine is not None and mine.etag == head.etag
            claimed = replace(head, generation=lease.generation, owner=self.remote.host_id, updated_utc=utc_stamp())
            try:
                written, _ = self.chain_objects.write_head(claimed, head, "takeover (claiming the head)")
            except LockedError:
                continue  # the former holder shipped one more turn meanwhile: read it again
            if not current:
                try:
                    assemble(self.objects, written, self.segment_key, self.remote.store, model=model)
                except RemoteStoreError:
                    raise
                except ColiError as exc:
                    raise RemoteStoreError(f"remote object store {self.objects.url}: takeover of session "
                                           f"{session_id!r} could not assemble its chain: {exc}") from None
            with self._lock:  # a background compaction reads the chain (its head write is If-Match)
                self._chains[session_id] = written
                self._epochs[session_id] = epoch = self.remote.store.snapshot(session_id).epoch
                self._keep_entries(session_id, epoch, written.nrec)
                self._prepared.pop(session_id, None)
                if not current:
                    self._written[session_id] = set()  # another host's segments: not this host's to delete
            log.info("ship.takeover", id=session_id, host=self.remote.host_id, nrec=written.nrec,
                     segments=written.count, fetched=not current)
            return not current
        raise LockedError(f"session {session_id!r}: its head kept changing while being claimed; try again")

    # ---- after a whole-bundle push, and a delete -------------------------------------------------
    def pushed(self, session_id: str, lease: Lease) -> None:
        """A push moved the lease's pointer to ``lease.bundle``: the chain is stale; delete it."""
        with self._lock:
            chain = self._chains.get(session_id)
            self._forget_chain(session_id)  # a prepared base is of this generation: the push's sweep deletes it
        stored = chain if chain is not None and chain.etag else self.chain_objects.read_head_quietly(session_id)
        if stored is None or stored.lease_bundle == lease.bundle:
            return
        if self.chain_objects.delete_head(stored):
            self.chain_objects.delete_chain(stored, keep=(lease.bundle,))

    def forget(self, session_id: str) -> None:
        """Delete the session's head, its base bundle and every segment (the session is deleted
        from the fleet)."""
        with self._lock:
            prepared = self._prepared.get(session_id)
            self._forget_chain(session_id)
        if prepared is not None:
            self.objects.delete(prepared.key)
        head = self.chain_objects.read_head_quietly(session_id)
        self.objects.delete(self.chain_objects.head_key(session_id))
        if head is not None and head.base is not None:
            self.objects.delete(head.base)
        self.chain_objects.delete_segments(session_id)

    def _forget_chain(self, session_id: str) -> None:
        self._chains.pop(session_id, None)
        self._epochs.pop(session_id, None)
        self._entries.pop(session_id, None)
        self._manifests.pop(session_id, None)
        self._written.pop(session_id, None)
        self._prepared.pop(session_id, None)  # unnamed, or named by a head this host may not touch now


__all__ = ["TurnShipper"]
