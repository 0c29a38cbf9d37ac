"""The object-store tier against a real S3 server (SeaweedFS, the run's one: tests/conftest.py) on
127.0.0.1, each test in a bucket of its own."""
from __future__ import annotations

import threading
import time

import pytest

from kernels.errors import ColiError, LockedError, NotFoundError
from sessionstore.migration.remote import RemoteStore
from sessionstore.sessions import SessionOptions
from sessionstore.sessions.store import SessionStore
from tests.support.migrate import make_session, session_files, stored_keys, tree_state


@pytest.fixture
def hosts(tmp_path, s3_bucket):
    url = s3_bucket.url("fleet")
    a = RemoteStore(SessionStore(tmp_path / "hostA"), url, host_id="host-a")
    b = RemoteStore(SessionStore(tmp_path / "hostB"), url, host_id="host-b")
    return a, b


def files(store, sid):
    return session_files(store, sid)


def test_push_then_pull_on_another_host(hosts):
    a, b = hosts
    make_session(a.store, "conv", 30)
    result, lease = a.push("conv")
    assert result.tokens == 30 and lease.released and lease.bundle
    got, held = b.pull("conv")
    assert got.tokens == 30 and held.owner == "host-b" and held.live()
    assert files(b.store, "conv") == files(a.store, "conv")


def test_a_live_lease_refuses_the_second_host_until_released(hosts):
    a, b = hosts
    make_session(a.store, "conv", 10)
    a.push("conv", release=False)  # host A keeps the session live
    with pytest.raises(LockedError, match="held live by host 'host-a'"):
        b.pull("conv")
    assert not b.store.exists("conv")
    a.push("conv")  # A suspends and releases
    b.pull("conv")
    assert b.store.info("conv").tokens == 10


def test_an_expired_lease_can_be_taken_and_the_old_holder_cannot_push_over_it(hosts, tmp_path):
    a, b = hosts
    short = RemoteStore(a.store, a.url, host_id="host-a", lease_ttl=0.5)
    make_session(a.store, "conv", 8)
    short.push("conv", release=False)
    time.sleep(0.7)
    b.pull("conv")  # A's lease expired: B takes over
    pointer = b.lease("conv").bundle
    with pytest.raises(LockedError):
        short.push("conv")
    assert b.lease("conv").bundle == pointer and b.lease("conv").owner == "host-b"
    assert stored_keys(a, "bundles", "conv") == [pointer]


def test_a_released_session_needs_a_pull_before_a_push(hosts):
    a, b = hosts
    make_session(a.store, "conv", 5)
    a.push("conv")
    with pytest.raises(LockedError, match="pull it first"):
        a.push("conv")
    make_session(b.store, "conv", 7, seed=2)
    with pytest.raises(LockedError):
        b.push("conv")


def test_two_hosts_racing_to_resume_exactly_one_wins(hosts):
    a, b = hosts
    for round_ in range(4):
        sid = f"race-{round_}"
        make_session(a.store, sid, 6)
        a.push(sid)
        a.store.delete(sid)
        racers = [RemoteStore(a.store, a.url, host_id="host-a"),
                  RemoteStore(b.store, b.url, host_id="host-b")]
        barrier = threading.Barrier(2)
        outcome: dict[str, str] = {}

        def race(remote: RemoteStore, barrier: threading.Barrier = barrier, sid: str = sid,
                 outcome: dict[str, str] = outcome) -> None:
            barrier.wait()
            try:
                remote.pull(sid)
                outcome[remote.host_id] = "won"
            except LockedError:
                outcome[remote.host_id] = "refused"

        threads = [threading.Thread(target=race, args=(r,)) for r in racers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcome.values()) == ["refused", "won"], outcome
        winner = next(h for h, o in outcome.items() if o == "won")
        lease = a.lease(sid)
        assert lease.owner == winner and lease.live()
        loser = racers[0] if winner == "host-b" else racers[1]
        assert not loser.store.exists(sid)


def test_pull_of_a_corrupt_bundle_leaves_the_store_unchanged_and_gives_the_lease_back(hosts):
    a, b = hosts
    make_session(a.store, "conv", 12)
    _, lease = a.push("conv")
    path = f"{a.bucket}/{lease.bundle}"
    data = bytearray(a.fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    a.fs.pipe_file(path, bytes(data))
    before = tree_state(b.store.root)
    with pytest.raises(ColiError):
        b.pull("conv")
    assert tree_state(b.store.root) == before
    after = b.lease("conv")
    assert after.released and after.bundle == lease.bundle


def test_pull_of_an_unknown_session_is_not_found(hosts):
    _, b = hosts
    with pytest.raises(NotFoundError):
        b.pull("nobody")
    assert b.lease("nobody") is None


def test_list_and_only_the_latest_bundle_is_kept(hosts):
    a, b = hosts
    make_session(a.store, "one", 3)
    make_session(a.store, "two", 4)
    a.push("one")
    a.push("two", release=False)
    a.push("two")
    listed = {lease.session_id: lease for lease in a.list()}
    assert set(listed) == {"one", "two"} and listed["two"].bundle_tokens == 4
    assert len(stored_keys(a, "bundles", "two")) == 1


def test_resume_refuses_while_another_host_holds_it(hosts):
    a, b = hosts
    make_session(a.store, "conv", 4)
    a.push("conv", release=False)
    with pytest.raises(LockedError):
        b.resume("conv")


def test_resume_pulls_then_reopens_a_real_session(hosts):
    a, b = hosts
    session = a.store.create("chat", "tiny", kv_dtype="fp8")
    first = session.generate([5, 6, 7, 8], 5).tokens
    session.close()
    a.push("chat")
    resumed = b.resume("chat")
    try:
        assert resumed.committed == 4 + 5 - 1 and resumed.pending == [first[-1]]
        assert b.lease("chat").owner == "host-b"
        resumed.generate(None, 3)
    finally:
        resumed.close()
    again = b.resume("chat")  # this host holds the lease: no pull, the local copy is used
    try:
        assert again.committed == 4 + 5 + 3 - 1
    finally:
        again.close()


def _remote(base: RemoteStore, host: str, **kw) -> RemoteStore:
    return RemoteStore(base.store, base.url, host_id=host, **kw)


def _push_a_chat(host: RemoteStore) -> None:
    """A real tiny-model session "chat" generated on ``host`` and pushed (lease released)."""
    session = host.store.create("chat", "tiny", kv_dtype="fp8")
    session.generate([5, 6, 7], 3)
    session.close()
    host.push("chat")


def test_a_resumed_session_keeps_its_lease_alive_past_the_ttl(hosts):
    a, b = hosts
    _push_a_chat(a)
    fast_b = _remote(b, "host-b", lease_ttl=1.2, renew_interval=0.3)
    live = fast_b.resume("chat")
    try:
        first = fast_b.lease("chat")
        time.sleep(2.5)  # twice the TTL: only the keeper's renewals keep it ours
        now = fast_b.lease("chat")
        assert now.owner == "host-b" and now.live() and now.generation == first.generation
        assert now.expires_at > first.expires_at and live.commits.guard.renewals >= 3
        with pytest.raises(LockedError, match="held live by host 'host-b'"):
            a.resume("chat")
        live.generate(None, 2)  # commits go on: the lease is ours
    finally:
        live.close()
    renewals = fast_b.lease("chat").expires_at
    time.sleep(0.8)
    assert fast_b.lease("chat").expires_at == renewals  # released with the session: no renewal


def test_a_lost_lease_fences_the_old_holders_commits(hosts):
    a, b = hosts
    _push_a_chat(a)
    slow_b = _remote(b, "host-b", lease_ttl=0.6, renew_interval=60)  # it will not renew in time
    live = slow_b.resume("chat", options=SessionOptions(commit_every=1))
    committed = live.committed
    time.sleep(0.8)
    a.pull("chat", replace=True)  # B's lease expired: A takes the session over
    with pytest.raises(LockedError, match="no longer holds its lease"):
        live.generate(None, 3)  # the first commit is refused
    live.abandon()
    assert b.store.info("chat").tokens == committed  # nothing more was committed on B
    assert a.lease("chat").owner == "host-a"
