"""``turn_ship_bytes_over_turn_records``, ``cut_shipped_bytes_ratio`` and ``takeover_s`` for
:mod:`bench.scale` and :mod:`bench.fleet_stores` (issue 25 part 3, issue 38 parts 2 and 4).

A GLM-5.2-shaped session (L=78, kv_lora 512, rope 64, fp8) on host A, paired with an S3 API server
on loopback (moto). Each rep is one turn: ``TURN_TOKENS`` records appended through the real writer
and committed, then shipped (:class:`TurnShipper`: one segment object plus the head). The figure is
the bytes uploaded (segment + head) over the turn's own record bytes; the baseline, in the same run,
is the whole-bundle push the fleet did before: the same commit exported as a bundle (its bytes over
the same record bytes, and its export time beside the ship's upload time).
``cut_shipped_bytes_ratio``: each rep also runs a *cut* turn on the same host, as a completions turn
whose prompt re-tokenizes the previous reply's last ``CUT_BACK`` tokens (the issue's case: 1,541 of
1,554 cached): the records are truncated by ``CUT_BACK`` (the epoch first) and ``CUT_BACK +
TURN_TOKENS`` new ones committed; the figure is its shipped bytes (a cut segment plus the head) over
those new records' bytes; baseline in the same run: the whole bundle a cut shipped before (its
export, over the same record bytes: ``cut_baseline_bundle_over_turn_records``).
``takeover_s``: host A stops renewing (as if SIGKILLed); host B waits for the lease to expire (TTL
``TAKEOVER_TTL_S``), takes it, claims the head and fetches base + segments into its store (the
verified import): TTL + fetch, medians over ``--reps`` takeovers alternating between the hosts.
Baseline in the same run: the raw read of the chain's base bundle through the same reader
(``takeover_fetch_over_raw_read``).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np

from bench.migrate import GLM, build_session
from bench.object_read import raw_read
from kernels.fp8 import quantize_rows
from kernels.rows import RecordRows
from sessionstore.kvfile import KVWriter

TURN_TOKENS = 64
CUT_BACK = 13  # the reply's last tokens that the next prompt re-tokenizes differently
TAKEOVER_TTL_S = 1.0


def grow(store: Any, sid: str, k: int, seed: int) -> int:
    """One turn's worth: ``k`` records appended and committed (the manifest says so); their bytes."""
    import dataclasses

    from sessionstore.sessions import write_manifest

    rng = np.random.default_rng(seed)
    lc = rng.standard_normal((k, GLM.n_layers, GLM.kv_lora)).astype(np.float32)  # [k, L, 512] f32
    rc = rng.standard_normal((k, GLM.n_layers, GLM.qk_rope)).astype(np.float32)  # [k, L, 64] f32
    lc_codes, lc_scale = quantize_rows(lc)  # [k, L, 512] u8, [k, L] f32
    rc_codes, rc_scale = quantize_rows(rc)  # [k, L, 64] u8, [k, L] f32
    manifest = store.read_manifest(sid)
    with KVWriter.open(store.kv_path(sid), GLM, kv_dtype="fp8") as writer:
        writer.append(RecordRows(tokens=rng.integers(0, GLM.vocab, size=k, dtype=np.int32), lc_codes=lc_codes,
                                 lc_scale=lc_scale, rc_codes=rc_codes, rc_scale=rc_scale))
        writer.commit()
        rec = int(writer.record_bytes)
    write_manifest(store.session_dir(sid) / "manifest.json",
                   dataclasses.replace(manifest, committed=manifest.committed + k))
    return k * rec


def cut(store: Any, sid: str, n: int) -> None:
    """Prefix reuse as a session does it (FORMAT.md 5.5): the manifest's epoch first, then the file."""
    import dataclasses

    from sessionstore.sessions import write_manifest

    manifest = store.read_manifest(sid)
    write_manifest(store.session_dir(sid) / "manifest.json",
                   dataclasses.replace(manifest, epoch=manifest.epoch + 1, committed=n, pending=[]))
    with KVWriter.open(store.kv_path(sid), GLM, kv_dtype="fp8") as writer:
        writer.truncate(n)


def bundle_bytes(host: Any, sid: str) -> tuple[int, float]:
    """What a whole-bundle push of the session's last commit uploads, and its export time."""
    from sessionstore.migration import export_session

    sink = _CountingSink()
    t = time.perf_counter()
    export_session(host.store, sid, cast(BinaryIO, sink), compression=host.compression)
    return sink.bytes, time.perf_counter() - t


class _CountingSink:
    """A binary sink that counts what is written and keeps nothing."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: Any) -> int:
        self.bytes += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def measure_shipping(args: argparse.Namespace, work: Path, bucket_url: str) -> dict[str, Any]:
    """Both keys; see the module."""
    from sessionstore.migration import RemoteStore
    from sessionstore.migration.shipping import TurnShipper
    from sessionstore.sessions import SessionStore

    tokens = 512 if args.quick else 4096
    url = f"{bucket_url}/shipping"
    hosts = [RemoteStore(SessionStore(work / name), url, host_id=name, lease_ttl=TAKEOVER_TTL_S)
             for name in ("host-a", "host-b")]
    shippers = [TurnShipper(h) for h in hosts]
    build_session(hosts[0].store, "s", tokens)
    lease = hosts[0].acquire("s")
    shippers[0].ship("s", lease)  # the chain's base (a new chain ships the whole commit once)

    ratios, bundle_ratios, ship_s, push_s, takeovers, fetches, raw_reads = [], [], [], [], [], [], []
    cut_ratios, cut_bundle_ratios, cut_bytes, cut_records = [], [], [], []
    holder, committed = 0, tokens
    for rep in range(args.reps):
        store = hosts[holder].store
        grow(store, "s", TURN_TOKENS, seed=rep + 1)
        t = time.perf_counter()
        report = shippers[holder].ship("s", lease)
        ship_s.append(time.perf_counter() - t)
        assert report.kind == "segment", report
        ratios.append(report.shipped_bytes / report.record_bytes)
        pushed, seconds = bundle_bytes(hosts[holder], "s")  # the baseline: a whole-bundle push of this commit
        push_s.append(seconds)
        bundle_ratios.append(pushed / report.record_bytes)
        cut(store, "s", committed + TURN_TOKENS - CUT_BACK)  # the next prompt re-tokenizes the reply's end
        grow(store, "s", CUT_BACK + TURN_TOKENS, seed=1000 + rep)
        committed += 2 * TURN_TOKENS
        report = shippers[holder].ship("s", lease)
        assert report.kind == "cut" and report.nrec - report.start == CUT_BACK + TURN_TOKENS, report
        cut_ratios.append(report.shipped_bytes / report.record_bytes)
        cut_bytes.append(report.shipped_bytes)
        cut_records.append(report.record_bytes)
        cut_bundle_ratios.append(bundle_bytes(hosts[holder], "s")[0] / report.record_bytes)
        # the holder 'dies': nothing renews its lease; the other host waits for it and fetches the chain
        other = 1 - holder
        time.sleep(max(0.0, lease.expires_at - time.time()))  # the TTL since its last renewal
        t1 = time.perf_counter()
        lease = hosts[other].acquire("s")
        assert shippers[other].take_over("s", lease, local_current=False)
        fetches.append(time.perf_counter() - t1)  # take the lease, claim the head, fetch and install
        takeovers.append(TAKEOVER_TTL_S + fetches[-1])
        assert hosts[other].store.read_manifest("s").committed == committed
        head = shippers[other].read_head("s")
        assert head is not None and head.base is not None
        t = time.perf_counter()
        raw_read(hosts[other].objects.url_of(head.base))  # the base's bytes alone, the same reader
        raw_reads.append(time.perf_counter() - t)
        holder = other
    return {"turn_ship_bytes_over_turn_records": statistics.median(ratios),
            "turn_ship_baseline_bundle_over_turn_records": statistics.median(bundle_ratios),
            "turn_ship_s": statistics.median(ship_s), "turn_ship_tokens": TURN_TOKENS,
            "turn_ship_baseline_export_s": statistics.median(push_s),
            "takeover_s": statistics.median(takeovers), "takeover_fetch_s": statistics.median(fetches),
            "takeover_base_raw_read_s": statistics.median(raw_reads),
            "takeover_fetch_over_raw_read": statistics.median(fetches) / statistics.median(raw_reads),
            "takeover_lease_ttl_s": TAKEOVER_TTL_S, "shipping_session_tokens": tokens,
            "cut_shipped_bytes_ratio": statistics.median(cut_ratios),
            "cut_baseline_bundle_over_turn_records": statistics.median(cut_bundle_ratios),
            "cut_shipped_bytes": statistics.median(cut_bytes), "cut_turn_record_bytes": statistics.median(cut_records),
            "cut_back_tokens": CUT_BACK}


__all__ = ["CUT_BACK", "TAKEOVER_TTL_S", "TURN_TOKENS", "bundle_bytes", "cut", "grow", "measure_shipping"]
