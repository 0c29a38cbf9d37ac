"""The per-commit state page (``manifest.json.state``), the two-level logits digest, the
compact manifest and the suspend path (state page instead of a manifest replace, deferred
unmap). Recovery from a torn or lost page stays exact."""
from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.errors import FormatError
from kernels.model.sampling import Sampler
from sessionstore.kvfile.mapping import wait_for_unmaps
from sessionstore.kvfile.reader import open_kv
from sessionstore.sessions import SessionOptions
from sessionstore.sessions.commit_state_page import (
    STATE_BYTES,
    StateWriter,
    decode_state,
    encode_state,
    read_state_page,
    state_path,
)
from sessionstore.sessions.digest import LogitsDigest, logits_hash, make_digest
from sessionstore.sessions.directory import STATE_NAME
from sessionstore.sessions.fields import MAX_PENDING
from sessionstore.sessions.manifest import MANIFEST_NAME, Manifest, ModelRef, read_manifest, write_manifest
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turn_loop import reference_turns
from tests.support.migrate import files_of

PROMPT = list(b"State pages")
SAMPLED = Sampler(0.9, 50, 0.95, 77)



def _manifest(**kw) -> Manifest:
    dims = dict(n_layers=2, kv_lora=8, qk_rope=4, index_head_dim=0, n_index_layers=0, vocab=64)
    return Manifest(id="s", model=ModelRef("tiny", "tiny", "fp1:" + "0" * 64), kv_dtype="fp8",
                    dims=dims, **kw)


# -- the digest ----------------------------------------------------------------------------------
def _sorted_digest(logits: np.ndarray, position: int, k: int = 8) -> LogitsDigest:
    """Oracle: a full sort by (value desc, id asc)."""
    logits = np.asarray(logits, dtype="<f4")
    order = sorted(range(logits.shape[0]), key=lambda i: (-float(logits[i]), i))[:k]
    return LogitsDigest(position, order, [float(logits[i]) for i in order], logits_hash(logits))


@settings(max_examples=150, deadline=None)
@given(n=st.sampled_from([1, 7, 8, 9, 1023, 1024, 1025, 3000, 5000]),
       k=st.sampled_from([1, 3, 8]),
       seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["normal", "few values", "constant", "infinities"]))
def test_digest_equals_a_full_sort(n, k, seed, kind) -> None:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal(n).astype(np.float32)
    elif kind == "few values":  # ties everywhere, at the cut too
        x = rng.integers(-2, 3, n).astype(np.float32)
    elif kind == "constant":
        x = np.full(n, -0.0, np.float32)
    else:
        x = rng.standard_normal(n).astype(np.float32)
        x[rng.integers(0, n, 3)] = np.inf
        x[rng.integers(0, n, 3)] = -np.inf
    assert make_digest(x, 5, k) == _sorted_digest(x, 5, k)


def test_digest_of_a_vocab_sized_vector_and_its_hash_in_place() -> None:
    x = np.random.default_rng(3).standard_normal(154_880).astype(np.float32)
    x[[10, 99_000, 154_879]] = 50.0  # a three-way tie at the top, across chunks and the tail
    digest = make_digest(x, 41)
    assert digest == _sorted_digest(x, 41) and digest.top_ids[:3] == [10, 99_000, 154_879]
    assert logits_hash(x) == logits_hash(np.frombuffer(x.tobytes(), "<f4"))
    strided = np.repeat(x, 2)[::2]  # not contiguous: hashed as its little-endian f32 values
    assert logits_hash(strided) == logits_hash(x)


# -- the manifest's bytes --------------------------------------------------------------------------
def test_manifest_is_one_compact_line_with_sorted_keys(tmp_path) -> None:
    m = _manifest(committed=3, pending=[5], last_logits=make_digest(np.arange(64, dtype=np.float32), 2))
    data = m.encode()
    assert data.endswith(b"\n") and data.count(b"\n") == 1 and b": " not in data
    doc = json.loads(data)
    assert list(doc) == sorted(doc) and doc["last_logits"]["top_ids"][0] == 63
    write_manifest(tmp_path / MANIFEST_NAME, m)
    assert read_manifest(tmp_path / MANIFEST_NAME) == m


# -- the state page --------------------------------------------------------------------------------
def test_state_page_round_trip_and_layout() -> None:
    m = _manifest(committed=7, epoch=2, pending=[1, 2], updated_at="2026-01-01T00:00:00.000000Z",
                  last_logits=make_digest(np.linspace(0, 1, 64, dtype=np.float32), 6))
    page = encode_state(m)
    assert len(page) == STATE_BYTES and page[:8] == b"COLIMST1"
    state = decode_state(page, 64, "p")
    assert state == {"epoch": 2, "committed": 7, "pending": [1, 2], "last_logits": m.last_logits,
                     "updated_at": m.updated_at, "seq": 0}
    assert decode_state(encode_state(m, 5), 64, "p")["seq"] == 5
    flipped = bytearray(page)
    flipped[30] ^= 1
    with pytest.raises(FormatError, match="check"):
        decode_state(bytes(flipped), 64, "p")
    with pytest.raises(FormatError, match="magic"):
        decode_state(b"X" * 4096, 64, "p")
    with pytest.raises(FormatError, match="shorter"):
        decode_state(b"", 64, "p")
    with pytest.raises(FormatError):
        decode_state(encode_state(_manifest(pending=[1])).replace(b'"pending":[1]', b'"pending":[9]'),
                     64, "p")  # changed: the check no longer matches


def test_read_manifest_applies_a_sound_page_of_the_same_epoch_only(tmp_path) -> None:
    path = tmp_path / MANIFEST_NAME
    base = _manifest(committed=3, epoch=1, pending=[4])
    write_manifest(path, base)
    newer = _manifest(committed=9, epoch=1, pending=[5], updated_at="later")
    StateWriter(path).write(newer)
    got = read_manifest(path)
    assert (got.committed, got.pending, got.updated_at) == (9, [5], "later")
    assert json.loads(path.read_bytes())["committed"] == 3  # the manifest file itself unchanged
    StateWriter(path).write(_manifest(committed=11, epoch=0))  # written before a truncate: ignored
    assert read_manifest(path).committed == 9  # the other slot, of this epoch
    StateWriter(path).write(_manifest(committed=12, epoch=0))  # both slots of another epoch
    assert read_manifest(path).committed == 3
    StateWriter(path).write(newer)
    page = bytearray(state_path(path).read_bytes())
    page[STATE_BYTES + 20] ^= 0x10  # slot 1 (this epoch's) torn or damaged: ignored; slot 0 is of
    state_path(path).write_bytes(bytes(page))  # epoch 0: the manifest's own (older) values are used
    assert read_manifest(path).committed == 3
    state_path(path).write_bytes(b"")  # created, never written
    assert read_manifest(path).committed == 3


def test_a_whole_manifest_write_updates_an_existing_page(tmp_path) -> None:
    path = tmp_path / MANIFEST_NAME
    write_manifest(path, _manifest(committed=3))
    assert not state_path(path).exists()  # never created by a whole write
    StateWriter(path).write(_manifest(committed=9, pending=[1]))
    write_manifest(path, _manifest(committed=4, pending=[]))  # e.g. a recovery at the same epoch
    got = read_manifest(path)
    assert (got.committed, got.pending) == (4, [])
    assert decode_state(read_state_page(path), 64, "p")["committed"] == 4


def test_a_torn_page_leaves_the_other_slot_in_effect(tmp_path) -> None:
    """Pages go to the two slots in turn, numbered: a write torn by a crash damages only its own
    slot, so the page written before it (a durable stream's tail, the only copy of tokens a
    client saw) is read instead (FORMAT.md 5.3.1)."""
    path = tmp_path / MANIFEST_NAME
    write_manifest(path, _manifest(committed=3))
    writer = StateWriter(path)
    for k in range(3):
        writer.write(_manifest(committed=3, pending=[1] * (k + 1)))
    assert read_manifest(path).pending == [1, 1, 1]  # seq 3, in slot 0
    raw = bytearray(state_path(path).read_bytes())
    assert len(raw) == 2 * STATE_BYTES
    raw[20] ^= 1  # slot 0 (the newest) torn
    state_path(path).write_bytes(bytes(raw))
    assert read_manifest(path).pending == [1, 1]  # slot 1, seq 2
    again = StateWriter(path)  # a new writer numbers on and never overwrites the newest sound slot
    again.write(_manifest(committed=3, pending=[2]))
    assert read_manifest(path).pending == [2] and again.seq == 4
    writer.close()
    again.close()


def test_symlinked_state_page_is_never_followed(tmp_path) -> None:
    path = tmp_path / MANIFEST_NAME
    write_manifest(path, _manifest(committed=3))
    target = tmp_path / "elsewhere"
    planted = encode_state(_manifest(committed=9))
    target.write_bytes(planted)
    os.symlink(target, state_path(path))
    assert read_manifest(path).committed == 3  # not read through the link
    with pytest.raises(FormatError, match="symlink"):
        StateWriter(path).write(_manifest(committed=10))
    assert target.read_bytes() == planted


# -- sessions ----------------------------------------------------------------------------------------
def test_commits_write_the_page_not_a_new_manifest(tmp_path) -> None:
    store = SessionStore(tmp_path)
    s = store.create("s", "tiny", kv_dtype="fp8", options=SessionOptions(commit_every=2))
    mpath = store.session_dir("s") / MANIFEST_NAME
    inode = mpath.stat().st_ino
    s.generate(PROMPT, 6)
    assert mpath.stat().st_ino == inode  # no replace: the manifest file is the same inode
    assert store.read_manifest("s").committed == s.committed == len(PROMPT) + 5
    assert json.loads(mpath.read_bytes())["committed"] == 0  # the page holds the commits
    assert set(s.commits.timing) == {"kv_commit_s", "state_wait_s", "state_write_s"}
    cache = weakref.ref(s.cache)
    s.suspend()
    assert set(s.suspend_timing) == {"commit_s", "release_s"}
    wait_for_unmaps()  # the background thread freed the cache and unmapped the file
    assert cache() is None
    assert str(store.kv_path("s").resolve()) not in Path("/proc/self/maps").read_text()
    assert [p.name for p in files_of(store, "s")][-1] == STATE_NAME
    info = store.directory.list()[0]
    assert info.tokens == len(PROMPT) + 5 and info.pending == s.pending  # listing sees the page
    s.close()


@pytest.mark.parametrize("damage", ["torn", "lost"])
def test_a_damaged_or_lost_page_recovers_exactly(tmp_path, tiny, damage) -> None:
    store = SessionStore(tmp_path)
    s = store.create("s", "tiny", kv_dtype="fp8", sampler=SAMPLED, options=SessionOptions(commit_every=3))
    s.generate(PROMPT, 9)
    s.close()
    page = state_path(store.session_dir("s") / MANIFEST_NAME)
    if damage == "torn":
        raw = bytearray(page.read_bytes())
        raw[40] ^= 0xFF  # both slots: the one of the last commit and the one before it
        raw[STATE_BYTES + 40] ^= 0xFF
        page.write_bytes(bytes(raw))
    else:
        page.unlink()
    assert store.read_manifest("s").committed != len(PROMPT) + 8  # only the manifest's old count
    s = store.open("s")
    assert s.resume_report["recovered"] is True and s.committed == len(PROMPT) + 8
    expected = reference_turns(tiny, "fp8", [(PROMPT, 9), (None, 5)], SAMPLED)
    assert s.history() == PROMPT + expected[0]
    assert s.generate(None, 5).tokens == expected[1]
    s.close()
    assert store.read_manifest("s").committed == len(PROMPT) + 13


def test_write_behind_and_staged_sessions_commit_the_same_bytes(tmp_path) -> None:
    """The writer's mode changes when bytes reach the file, never which bytes are committed."""
    out = []
    for write_behind in (True, False):
        store = SessionStore(tmp_path / str(write_behind))
        s = store.create("s", "tiny", kv_dtype="fp8", options=SessionOptions(commit_every=3, write_behind=write_behind))
        tokens = s.generate(PROMPT, 9).tokens + s.generate([7, 8, 9], 4).tokens
        s.close()
        with open_kv(store.kv_path("s")) as r:
            out.append((tokens, r.nrec, r.records_bytes_view(0, r.nrec).tobytes()))
    assert out[0] == out[1]


def test_a_page_holds_max_pending_ids_of_any_vocab_with_a_digest() -> None:
    """A durable stream's tail commit puts up to MAX_PENDING ids on the page (a longer tail is a
    kv commit instead): they fit with the longest digest, counts and timestamp."""
    big = (1 << 31) - 1
    logits = np.full(64, -3.4028234663852886e38, dtype=np.float32)  # the longest decimals
    m = _manifest(committed=big, epoch=(1 << 63) - 1, pending=[big - 1] * MAX_PENDING,
                  last_logits=make_digest(logits, big - 1), updated_at="2026-12-03T18:00:00.000000Z")
    page = encode_state(m, (1 << 63) - 1)
    assert decode_state(page, big, "p")["pending"] == [big - 1] * MAX_PENDING
