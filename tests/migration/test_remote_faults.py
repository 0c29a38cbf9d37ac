"""The object-store tier under faults (issue 10): moto's S3 server on loopback behind a relay
(tests/s3_relay.py) that holds a request, cuts the store in the middle of one, or drops an
answer. Hosts are real ``coli-kv`` processes (host A behind the relay, others straight to the
store). Each case checks the exit code, a single stderr line, the local session, the store's
objects (no orphans) and token-exact continuation by the next holder."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sessionstore.migration import RemoteStore, RemoteStoreError
from sessionstore.sessions.store import SessionStore
from tests.support.migrate import S3_BUCKET, s3_endpoint, tree_state  # noqa: F401
from tests.support.s3_relay import DOWN, HOLD, LOSE_ANSWER, PASS, Relay, Request
from tools.coli_kv import main

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[2]
PROMPT_A = "72,101,108,108,111"
PROMPT_B = "7,8,9"
TURNS = ("6", "5", "4", "3")  # --max-new of turns 1, 2, 3, 4
SID = "s"


@pytest.fixture
def fleet(s3_endpoint, request):  # the moto fixture
    """(s3 URL of this test's prefix, the relay in front of the store)."""
    prefix = request.node.name.replace("[", "-").replace("]", "")
    relay = Relay(("127.0.0.1", int(s3_endpoint.rsplit(":", 1)[1])))
    yield f"s3://{S3_BUCKET}/{prefix}", relay
    relay.close()


def coli(*args: str, endpoint: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``coli-kv ARGS`` in a fresh process (stderr whole, exit-time messages included), through
    ``endpoint`` (the relay) or straight to the store; the client retries briefly."""
    env = {k: v for k, v in os.environ.items() if k != "COLI_LOG"}  # the default log level
    env["AWS_MAX_ATTEMPTS"] = "2"
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    return subprocess.run([sys.executable, "-m", "tools.coli_kv", *args], check=False, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def here(capsys, *args: str) -> subprocess.CompletedProcess:
    """``coli-kv ARGS`` in this process, straight to the store: a host no fault touches."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def gen(root: Path, url: str, host: str, turn: int, *extra: str, prompt: str | None = None) -> list[str]:
    first = ["--model", "tiny", "--prompt-ids", prompt, "--temperature", "0.8", "--seed", "3"] \
        if prompt else []
    return ["generate", "--root", str(root), "--session", SID, "--remote", url, "--host-id", host,
            "--max-new", TURNS[turn - 1], "--json", *first, *extra]


def reference(tmp_path: Path, prompt: str, capsys) -> list[list[int]]:
    """The tokens of every turn of an uninterrupted conversation (no fleet, one store)."""
    root = tmp_path / f"ref-{prompt}"
    out = []
    for turn in range(1, len(TURNS) + 1):
        first = ["--model", "tiny", "--prompt-ids", prompt, "--temperature", "0.8", "--seed", "3"] \
            if turn == 1 else []
        assert main(["generate", "--root", str(root), "--session", SID, "--max-new",
                     TURNS[turn - 1], "--json", *first]) == 0
        out.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"])
    return out


def result(run: subprocess.CompletedProcess) -> dict:
    return json.loads(run.stdout.strip().splitlines()[-1])


def one_error(run: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == code and len(lines) == 1, (run.returncode, run.stderr)
    assert lines[0].startswith("coli-kv "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def printed_despite_failure(run: subprocess.CompletedProcess, tokens: list[int]) -> None:
    """The turn's tokens on stdout (plain and --json) with the push failure beside them."""
    first = run.stdout.strip().splitlines()[0]
    assert first == ",".join(map(str, tokens)), run.stdout
    out = result(run)
    assert out["tokens"] == tokens and out["remote"]["pushed"] is False and out["remote"]["error"]


def succeeded(run: subprocess.CompletedProcess, tokens: list[int]) -> dict:
    assert run.returncode == 0 and run.stderr == "", run.stderr
    out = result(run)
    assert out["tokens"] == tokens and out["remote"]["pushed"] is True
    return out


def sound(root: Path, committed: int, capsys) -> None:
    store = SessionStore(root, create=False)
    assert store.info(SID).tokens == committed
    assert main(["verify", str(store.kv_path(SID))]) == 0, capsys.readouterr()
    capsys.readouterr()


def objects(url: str) -> list[str]:
    """Every object under the prefix (relative keys), unfinished multipart uploads included."""
    import s3fs

    fs = s3fs.S3FileSystem()
    bucket, _, prefix = url[len("s3://"):].partition("/")
    found = [k.split("/", 2)[2] for k in fs.find(f"{bucket}/{prefix}", refresh=True)]
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    return sorted(found + [f"upload:{u['Key']}" for u in uploads])


def lease_of(url: str) -> dict:
    import s3fs

    return json.loads(s3fs.S3FileSystem().cat_file(f"{url[len('s3://'):]}/leases/{SID}.json"))


def one_bundle(url: str) -> str:
    """The store holds the lease and exactly the one bundle it points at."""
    keys = objects(url)
    pointer = lease_of(url)["bundle"]
    prefix = url[len("s3://"):].split("/", 1)[1]
    assert pointer is not None and keys == sorted([f"{pointer[len(prefix) + 1:]}",
                                                   f"leases/{SID}.json"]), keys
    return pointer


def committed_after(prompt: str, turns: int) -> int:
    """Records committed after ``turns`` turns (the last generated token stays pending)."""
    return len(prompt.split(",")) + sum(int(t) for t in TURNS[:turns]) - 1


def at_pointer_write(then: str, *, after: bool = False) -> Callable[[Request], str]:
    """A rule: ``then`` for the push's pointer write (the first lease PUT after a bundle PUT),
    or with ``after`` for the request that follows it; PASS otherwise."""
    state = {"bundle": False, "pointer": False, "done": False}

    def rule(req: Request) -> str:
        if state["done"]:
            return PASS
        if state["pointer"]:
            state["done"] = True
            return then
        if req.method == "PUT" and "/bundles/" in req.path:
            state["bundle"] = True
        elif state["bundle"] and req.method == "PUT" and "/leases/" in req.path:
            if not after:
                state["done"] = True
                return then
            state["pointer"] = True
        return PASS

    return rule


def on_first(method: str, part: str, then: str) -> Callable[[Request], str]:
    """A rule: ``then`` for the first ``method`` request whose path holds ``part``."""
    state = {"done": False}

    def rule(req: Request) -> str:
        if not state["done"] and req.method == method and part in req.path:
            state["done"] = True
            return then
        return PASS

    return rule


# --- part 2: a lost or failing store is one line; the turn's output is not lost -------------------
def test_store_killed_mid_bundle_put_then_back_with_its_data(tmp_path, fleet, capsys):
    url, relay = fleet
    ref = reference(tmp_path, PROMPT_A, capsys)
    relay.rule = on_first("PUT", "/bundles/", DOWN)
    run = coli(*gen(tmp_path / "A", url, "host-a", 1, prompt=PROMPT_A), endpoint=relay.url)
    one_error(run, 1, url, "push (uploading bundle", "session 's'", "failed")
    printed_despite_failure(run, ref[0])
    sound(tmp_path / "A", committed_after(PROMPT_A, 1), capsys)
    assert objects(url) == [f"leases/{SID}.json"]  # the cut upload left nothing
    assert lease_of(url)["owner"] == "host-a" and lease_of(url)["bundle"] is None

    relay.up()  # the store is back, its data intact: A's next turn pushes both turns
    succeeded(coli(*gen(tmp_path / "A", url, "host-a", 2), endpoint=relay.url), ref[1])
    one_bundle(url)
    succeeded(here(capsys, *gen(tmp_path / "B", url, "host-b", 3)), ref[2])  # the next holder, exact
    one_bundle(url)


def test_store_killed_before_the_pointer_write_leaves_no_orphan_after_the_next_push(tmp_path, fleet,
                                                                                    capsys):
    url, relay = fleet
    ref = reference(tmp_path, PROMPT_A, capsys)
    relay.rule = at_pointer_write(DOWN)  # the upload lands, the store dies at the pointer
    run = coli(*gen(tmp_path / "A", url, "host-a", 1, prompt=PROMPT_A), endpoint=relay.url)
    one_error(run, 1, url, "pointing the lease at bundle", "session 's'")
    printed_despite_failure(run, ref[0])
    sound(tmp_path / "A", committed_after(PROMPT_A, 1), capsys)
    assert len(objects(url)) == 2 and lease_of(url)["bundle"] is None  # an upload nobody points at

    relay.up()
    succeeded(coli(*gen(tmp_path / "A", url, "host-a", 2), endpoint=relay.url), ref[1])
    one_bundle(url)  # the next push swept the orphan
    succeeded(here(capsys, *gen(tmp_path / "B", url, "host-b", 3)), ref[2])


def test_store_restarted_empty_is_one_line_naming_the_missing_bucket(tmp_path, fleet, capsys):
    import s3fs

    _, relay = fleet
    bucket = "faults-empty"
    fs = s3fs.S3FileSystem()
    fs.mkdir(bucket)
    url = f"s3://{bucket}/fleet"
    ref = reference(tmp_path, PROMPT_A, capsys)
    succeeded(coli(*gen(tmp_path / "A", url, "host-a", 1, prompt=PROMPT_A), endpoint=relay.url),
              ref[0])
    relay.rule = on_first("PUT", "/bundles/", DOWN)
    run = coli(*gen(tmp_path / "A", url, "host-a", 2), endpoint=relay.url)
    one_error(run, 1, url, "push (uploading bundle", "session 's'")
    printed_despite_failure(run, ref[1])

    fs.rm(bucket, recursive=True)  # the store comes back empty: no bucket at all
    fs.invalidate_cache()
    relay.up()
    before = tree_state(tmp_path / "A")
    run = coli(*gen(tmp_path / "A", url, "host-a", 3), endpoint=relay.url)
    one_error(run, 1, url, "reading the lease for session 's'",
              f"the bucket '{bucket}' does not exist")
    assert run.stdout == "" and tree_state(tmp_path / "A") == before  # refused before the turn
    sound(tmp_path / "A", committed_after(PROMPT_A, 2), capsys)

    fs.mkdir(bucket)  # recreated: A's copy (both turns) becomes the fleet's again
    succeeded(coli(*gen(tmp_path / "A", url, "host-a", 3), endpoint=relay.url), ref[2])
    one_bundle(url)
    succeeded(here(capsys, *gen(tmp_path / "B", url, "host-b", 4)), ref[3])


# --- part 4: no session id gets stuck ---------------------------------------------------------
def test_a_first_push_cut_after_its_lease_exists_does_not_block_the_id(tmp_path, fleet, capsys):
    url, relay = fleet
    ref_b = reference(tmp_path, PROMPT_B, capsys)
    relay.rule = on_first("PUT", "/bundles/", DOWN)
    run = coli(*gen(tmp_path / "A", url, "host-a", 1, "--lease-ttl", "6", prompt=PROMPT_A),
               endpoint=relay.url)
    one_error(run, 1, "push (uploading bundle")
    sound(tmp_path / "A", committed_after(PROMPT_A, 1), capsys)
    assert objects(url) == [f"leases/{SID}.json"] and lease_of(url)["bundle"] is None

    # while A's lease is live, every other host is refused as held by A (exit 4), one wording
    held = "is held live by host 'host-a'"
    one_error(here(capsys, *gen(tmp_path / "B", url, "host-b", 1, prompt=PROMPT_B)), 4, held)
    one_error(here(capsys, "pull", "--root", str(tmp_path / "B"), "--remote", url,
                   "--host-id", "host-b", SID), 4, held)
    assert not (tmp_path / "B").exists()

    time.sleep(max(0.0, lease_of(url)["expires_at"] - time.time()) + 0.2)
    # expired with no bundle: another host creates the session (a conditional write)
    succeeded(here(capsys, *gen(tmp_path / "B", url, "host-b", 1, prompt=PROMPT_B)), ref_b[0])
    one_bundle(url)
    relay.up()  # A's own copy was never the fleet's: A continues B's session, token-exact
    succeeded(coli(*gen(tmp_path / "A", url, "host-a", 2), endpoint=relay.url), ref_b[1])
    one_bundle(url)


def test_an_expired_lease_without_a_bundle_can_be_released_by_any_host(tmp_path, fleet, capsys):
    url, _ = fleet
    a = RemoteStore(SessionStore(tmp_path / "A"), url, host_id="host-a", lease_ttl=0.5)
    a.acquire(SID)  # a creator that died before its first push
    assert main(["lease", "--root", str(tmp_path / "B"), "--remote", url, "--host-id", "host-b",
                 SID, "--release"]) == 4
    assert "is held live by host 'host-a'" in capsys.readouterr().err
    time.sleep(0.6)
    assert main(["lease", "--root", str(tmp_path / "B"), "--remote", url, "--host-id", "host-b",
                 SID, "--release"]) == 0
    assert "lease deleted" in capsys.readouterr().out
    assert objects(url) == []


def test_creation_races_have_one_winner_and_a_loser_held_by_it(tmp_path, fleet, capsys):
    url, relay = fleet
    refs = {"host-a": reference(tmp_path, PROMPT_A, capsys),
            "host-b": reference(tmp_path, PROMPT_B, capsys)}
    prompts = {"host-a": PROMPT_A, "host-b": PROMPT_B}
    # round 1: both hosts' conditional creates of the lease are held, then let go together
    creates: list[str] = []

    def together(req: Request) -> str:
        if req.method == "PUT" and "/leases/" in req.path and "if-none-match" in req.headers:
            creates.append(req.path)
            if len(creates) == 2:
                relay.release()
                return PASS
            return HOLD
        return PASS

    relay.rule = together
    runs: dict[str, subprocess.CompletedProcess] = {}

    def host(name: str) -> None:
        runs[name] = coli(*gen(tmp_path / name, url, name, 1, prompt=prompts[name]),
                          endpoint=relay.url)

    threads = [threading.Thread(target=host, args=(h,)) for h in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(creates) == 2
    winner = next(h for h, r in runs.items() if r.returncode == 0)
    loser = next(h for h in prompts if h != winner)
    succeeded(runs[winner], refs[winner][0])
    sound(tmp_path / winner, committed_after(prompts[winner], 1), capsys)
    one_error(runs[loser], 4, f"is held live by host '{winner}'")
    assert runs[loser].stdout == "" and not (tmp_path / loser).exists()
    one_bundle(url)
    # the loser's next turn continues the winner's session, token-exact
    succeeded(here(capsys, *gen(tmp_path / loser, url, loser, 2)), refs[winner][1])

    # round 2: a host arrives while the creator's first push is in flight (lease, no bundle)
    url2 = url + "-2"
    relay.rule = on_first("PUT", "/bundles/", HOLD)
    relay.rearm()
    creator: dict[str, subprocess.CompletedProcess] = {}
    t = threading.Thread(target=lambda: creator.update(run=coli(
        *gen(tmp_path / "C", url2, "host-c", 1, prompt=PROMPT_A), endpoint=relay.url)))
    t.start()
    assert relay.held.wait(30)
    one_error(here(capsys, *gen(tmp_path / "D", url2, "host-d", 1, prompt=PROMPT_B)), 4,
              "is held live by host 'host-c'")
    relay.release()
    t.join()
    succeeded(creator["run"], refs["host-a"][0])
    one_bundle(url2)


# --- part 1: a push that landed is reported as landed -----------------------------------------
def test_a_landed_push_is_a_success_though_another_host_takes_the_session_at_once(tmp_path, fleet,
                                                                                  capsys):
    url, relay = fleet
    ref = reference(tmp_path, PROMPT_A, capsys)
    relay.rule = at_pointer_write(HOLD, after=True)  # the request after the pointer write waits
    pusher: dict[str, subprocess.CompletedProcess] = {}
    t = threading.Thread(target=lambda: pusher.update(run=coli(
        *gen(tmp_path / "A", url, "host-a", 1, prompt=PROMPT_A), endpoint=relay.url)))
    t.start()
    try:
        assert relay.held.wait(30), [r.path for r in relay.seen]
        # meanwhile host B pulls exactly that push, continues and pushes its own turn
        assert main(gen(tmp_path / "B", url, "host-b", 2)) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == ref[1]
    finally:
        relay.release()
        t.join()
    out = succeeded(pusher["run"], ref[0])  # landed, and said so: exit 0, no error line
    sound(tmp_path / "A", committed_after(PROMPT_A, 1), capsys)
    assert out["remote"]["generation"] == 1
    assert lease_of(url)["owner"] == "host-b" and lease_of(url)["generation"] == 2
    one_bundle(url)  # A's superseded bundle is gone, B's is the only one
    succeeded(here(capsys, *gen(tmp_path / "A", url, "host-a", 3)), ref[2])


def test_a_pointer_write_whose_answer_was_lost_is_a_landed_push(tmp_path, fleet, capsys):
    url, relay = fleet
    ref = reference(tmp_path, PROMPT_A, capsys)
    relay.rule = at_pointer_write(LOSE_ANSWER)  # it lands; the client retries, gets 412
    succeeded(coli(*gen(tmp_path / "A", url, "host-a", 1, prompt=PROMPT_A), endpoint=relay.url),
              ref[0])
    assert lease_of(url)["released"] and lease_of(url)["owner"] == "host-a"
    sound(tmp_path / "A", committed_after(PROMPT_A, 1), capsys)
    one_bundle(url)
    succeeded(here(capsys, *gen(tmp_path / "B", url, "host-b", 2)), ref[1])


# --- part 3: the lease keeper survives outages shorter than the lease -------------------------
def test_the_keeper_renews_after_an_outage_longer_than_the_retries(tmp_path, fleet, capfd):
    url, relay = fleet
    a = RemoteStore(SessionStore(tmp_path / "A"), url, host_id="host-a")
    session = a.store.create("chat", "tiny", kv_dtype="fp8")
    first = session.generate([5, 6, 7], 3).tokens
    session.close()
    a.push("chat")
    through_relay = {"client_kwargs": {"endpoint_url": relay.url},
                     "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}},
                     "skip_instance_cache": True}
    b = RemoteStore(SessionStore(tmp_path / "B"), url, host_id="host-b", lease_ttl=10,
                    renew_interval=0.5, storage_options=through_relay)
    live = b.resume("chat")
    try:
        keeper = live.commits.guard
        time.sleep(0.8)
        assert keeper.renewals >= 1
        relay.down()
        t0 = time.time()
        with pytest.raises(RemoteStoreError, match="reading the lease for session 'chat'"):
            b.lease("chat")  # the client's retries give up while the store is still down
        retries_s = time.time() - t0
        renewals = keeper.renewals
        time.sleep(2.0)
        outage_s = time.time() - t0  # longer than the retries, shorter than the 10 s lease
        assert keeper.renewals == renewals and keeper.lost is None and outage_s > retries_s
        relay.up()
        deadline = time.time() + 6
        while keeper.renewals == renewals and time.time() < deadline:
            time.sleep(0.1)
        assert keeper.renewals > renewals and keeper.lost is None, keeper.lost
        lease = a.lease("chat")
        assert lease.owner == "host-b" and lease.live() and lease.expires_at > time.time() + 5
        second = live.generate(None, 2).tokens  # commits go on: the lease stayed ours
    finally:
        live.close()
    assert "Traceback" not in capfd.readouterr().err
    b.push("chat")
    again = a.resume("chat")  # the next holder continues token-exact
    try:
        third = again.generate(None, 3).tokens
    finally:
        again.close()
    ref = SessionStore(tmp_path / "ref").create("chat", "tiny", kv_dtype="fp8")
    try:
        assert [ref.generate([5, 6, 7], 3).tokens, ref.generate(None, 2).tokens,
                ref.generate(None, 3).tokens] == [first, second, third]
    finally:
        ref.close()


# --- part 2: an unfinished multipart upload is not left behind --------------------------------
def test_a_multipart_upload_cut_by_the_store_is_aborted_by_the_next_push(tmp_path, fleet):
    from tests.support.migrate import make_session, session_files

    url, relay = fleet
    store = SessionStore(tmp_path / "A")
    make_session(store, "big", 36000)  # a ~5.6 MiB bundle: two parts (5 MiB and the rest)
    through_relay = {"client_kwargs": {"endpoint_url": relay.url}, "default_block_size": 5 << 20,
                     "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}},
                     "skip_instance_cache": True}
    a = RemoteStore(store, url, host_id="host-a", storage_options=through_relay,
                    compression="none")
    relay.rule = on_first("PUT", "partNumber=2", DOWN)
    with pytest.raises(RemoteStoreError, match=r"push \(uploading bundle .*session 'big' failed"):
        a.push("big")
    relay.up()
    assert any(k.startswith("upload:") for k in objects(url))  # the store kept the parts
    a.push("big")
    keys = objects(url)
    assert not any(k.startswith("upload:") for k in keys) and len(keys) == 2, keys  # aborted
    b = RemoteStore(SessionStore(tmp_path / "B"), url, host_id="host-b")
    b.pull("big")
    assert session_files(b.store, "big") == session_files(store, "big")
