"""The tier policy (FORMAT.md 5.10) as a pure function: retention expiry, least-recently-used
offload past the disk budget, pins and busy sessions never moved, and whether a plan fits."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessionstore.sessions.tier_policy import SessionUse, epoch_of, expired, plan_tiers


def use(sid: str, size: int, last: float, **kw: object) -> SessionUse:
    return SessionUse(sid, size, last, **kw)  # type: ignore[arg-type]


def test_retention_expires_at_last_use_plus_retention_unless_pinned_or_busy() -> None:
    assert not expired(use("a", 1, 100.0, retention_s=10), 109.9)
    assert expired(use("a", 1, 100.0, retention_s=10), 110.0)
    assert not expired(use("a", 1, 100.0, retention_s=10, pinned=True), 1e9)
    assert not expired(use("a", 1, 100.0, retention_s=10, busy=True), 1e9)
    assert not expired(use("a", 1, 100.0), 1e12)  # no retention: kept until deleted
    plan = plan_tiers([use("a", 1, 0.0, retention_s=5), use("b", 1, 0.0, retention_s=5, offloaded=True),
                       use("c", 1, 0.0, retention_s=50)], now=10.0)
    assert plan.expire == ("a", "b") and plan.offload == () and plan.fits


def test_offloads_least_recently_used_idle_unpinned_until_the_need_fits() -> None:
    uses = [use("new", 40, 300.0), use("old", 30, 100.0), use("pin", 50, 50.0, pinned=True),
            use("mid", 30, 200.0), use("busy", 10, 10.0, busy=True), use("gone", 99, 1.0, offloaded=True)]
    plan = plan_tiers(uses, now=400.0, budget=130, needed=20)  # local 160 + 20 -> <= 130
    assert plan.offload == ("old", "mid") and plan.local_bytes == 100 and plan.fits
    assert plan_tiers(uses, now=400.0, budget=1000, needed=20).offload == ()
    tight = plan_tiers(uses, now=400.0, budget=50, needed=20)  # pin 50 + busy 10 stay: never fits
    assert not tight.fits and "pin" not in tight.offload and "busy" not in tight.offload
    no_remote = plan_tiers(uses, now=400.0, budget=130, needed=20, can_offload=False)
    assert no_remote.offload == () and not no_remote.fits and no_remote.local_bytes == 160


def test_expired_sessions_free_their_bytes_before_any_offload() -> None:
    uses = [use("due", 100, 0.0, retention_s=1), use("lru", 50, 5.0), use("recent", 50, 9.0)]
    plan = plan_tiers(uses, now=10.0, budget=100)
    assert plan.expire == ("due",) and plan.offload == () and plan.fits


def test_ties_in_last_use_go_by_id_and_a_negative_need_is_refused() -> None:
    plan = plan_tiers([use("b", 10, 1.0), use("a", 10, 1.0), use("c", 10, 1.0)], now=2.0, budget=15)
    assert plan.offload == ("a", "b")
    with pytest.raises(ValueError):
        plan_tiers([], now=0.0, needed=-1)


@given(st.lists(st.tuples(st.integers(0, 1000), st.floats(0, 1e6), st.booleans(), st.booleans(), st.booleans()),
                max_size=30), st.integers(0, 20_000), st.integers(0, 2000))
def test_a_plan_never_moves_pinned_or_busy_and_fits_exactly_when_it_says(
        rows: list[tuple[int, float, bool, bool, bool]], budget: int, needed: int) -> None:
    uses = [use(f"s{i}", size, last, pinned=pin, busy=busy, offloaded=off)
            for i, (size, last, pin, busy, off) in enumerate(rows)]
    plan = plan_tiers(uses, now=2e6, budget=budget, needed=needed)
    by_id = {u.id: u for u in uses}
    assert not any(by_id[s].pinned or by_id[s].busy or by_id[s].offloaded for s in plan.offload)
    local = sum(u.bytes for u in uses if not u.offloaded) - sum(by_id[s].bytes for s in plan.offload)
    assert plan.local_bytes == local and plan.fits == (local + needed <= budget)
    offloaded_last = [by_id[s].last_use for s in plan.offload]
    kept = [u.last_use for u in uses if not (u.offloaded or u.pinned or u.busy) and u.id not in plan.offload]
    if plan.offload and kept:  # least recently used first: nothing kept is older than what went
        assert min(kept) >= max(offloaded_last)


def test_epoch_of_reads_the_manifest_time_and_calls_garbage_the_oldest() -> None:
    assert epoch_of("1970-01-01T00:00:10.500000Z") == 10.5
    assert epoch_of("") == 0.0 and epoch_of("yesterday") == 0.0
