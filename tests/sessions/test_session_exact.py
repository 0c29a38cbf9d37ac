"""Token-exact resume: an interrupted session generates exactly what an uninterrupted run does.

The uninterrupted reference (``reference_turns``) runs every turn in one process on one in-memory
cache with no store. The interrupted runs go generate -> suspend -> NEW PROCESS -> resume ->
generate, in f32 and fp8, greedy and sampled, at several split points, with prefix reuse
(continuation and divergence) and forks.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.errors import CorruptionError, ModelMismatchError
from kernels.model.sampling import Sampler
from sessionstore.kvfile.reader import open_kv
from sessionstore.sessions import SessionOptions
from sessionstore.sessions.manifest import MANIFEST_NAME, read_manifest, write_manifest
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turn_loop import reference_turns
from tests.support.session_util import run_child, write_tiny_checkpoint

PROMPT = list(b"The quick brown fox")
CONFIGS = {
    "f32-greedy": ("f32", (0.0, 0, 1.0, 0)),
    "fp8-greedy": ("fp8", (0.0, 0, 1.0, 0)),
    "f32-sampled": ("f32", (0.9, 40, 0.95, 11)),
    "fp8-sampled": ("fp8", (1.0, 0, 1.0, 12345)),
}



def _turn_prompts(ref0: list[int], ref1: list[int]) -> tuple[list[int], list[int]]:
    """Turn 3 continues the whole conversation; turn 4 diverges after 2 generated tokens."""
    turn3 = PROMPT + ref0 + ref1 + list(b" and then")
    turn4 = PROMPT + ref0[:2] + list(b"!? other")
    return turn3, turn4


def test_multi_process_chain_is_token_exact(tmp_path, tiny) -> None:
    """4 processes, 4 configs each: create+turn, continue, prompt continuation, divergence."""
    expected, turns = {}, {}
    for name, (kv, samp) in CONFIGS.items():
        sampler = Sampler(*samp)
        first = reference_turns(tiny, kv, [(PROMPT, 5), (None, 9)], sampler)
        t3, t4 = _turn_prompts(*first)
        turns[name] = [(PROMPT, 5), (None, 9), (t3, 6), (t4, 7)]
        expected[name] = reference_turns(tiny, kv, turns[name], sampler)
        assert len(set(sum(expected[name], []))) > 3  # a run that actually says something
    root = str(tmp_path / "store")
    commit_every = [1, 3, 64, 2]
    for step in range(4):
        jobs = []
        for name, (kv, samp) in CONFIGS.items():
            prompt, max_new = turns[name][step]
            job = {"id": name, "prompt": prompt, "max_new": max_new, "commit_every": commit_every[step]}
            if step == 0:
                job["create"] = {"kv": kv, "sampler": list(samp)}
            jobs.append(job)
        out = run_child({"root": root, "jobs": jobs})
        for name in CONFIGS:
            assert out[name]["tokens"] == expected[name][step], (name, step)
            if step:
                assert out[name]["resume"]["verified"] == "bit-identical", (name, step)
    store = SessionStore(root)
    # turn 4 diverged: the history was cut back to the common prefix, then extended
    for name in CONFIGS:
        info = store.info(name)
        t4 = turns[name][3][0]
        assert info.tokens == len(t4) + len(expected[name][3]) - 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kv=st.sampled_from(["f32", "fp8"]),
       sampled=st.booleans(),
       seed=st.integers(0, 2**32),
       prompt=st.lists(st.integers(0, 259), min_size=1, max_size=12),
       plan=st.lists(st.tuples(st.sampled_from(["continue", "extend", "diverge"]), st.integers(0, 7)),
                     min_size=1, max_size=4),
       commit_every=st.sampled_from([1, 2, 5, 64]))
def test_any_split_is_token_exact(tmp_path_factory, tiny, kv, sampled, seed, prompt, plan, commit_every) -> None:
    """Random turns, each on a freshly opened Session (everything reloaded from disk)."""
    sampler = Sampler(0.8, 30, 0.9, seed) if sampled else Sampler()
    turns: list[tuple[list[int] | None, int]] = [(prompt, 3)]
    root = tmp_path_factory.mktemp("store")
    store = SessionStore(root)
    s = store.create("s", "tiny", kv_dtype=kv, sampler=sampler, options=SessionOptions(commit_every=commit_every))
    got = [s.generate(prompt, 3).tokens]
    s.close()
    for kind, max_new in plan:
        history = SessionStore(root).history("s")  # records + pending, from disk, no lock
        if kind == "continue":
            turn = (None, max_new)
        elif kind == "extend":
            turn = (history + [7, 8], max_new)
        else:
            cut = max(1, len(history) // 2)
            turn = (history[:cut] + [9, 10, 11], max_new)
        turns.append(turn)
        fresh = SessionStore(root)  # a new store: no state shared with the previous turn
        s = fresh.open("s", options=SessionOptions(commit_every=commit_every))
        assert s.resume_report["verified"] in ("bit-identical", "recomputed (no digest to compare)")
        got.append(s.generate(turn[0], turn[1]).tokens)
        s.close()
    assert got == reference_turns(tiny, kv, turns, sampler)


@pytest.mark.parametrize("kv", ["f32", "fp8", "int4", "polar4"])
def test_fork_continues_exactly(tmp_path, tiny, kv) -> None:
    """A fork at n inside the generated text re-generates the source's tokens after n."""
    sampler = Sampler(0.7, 0, 1.0, 99)
    store = SessionStore(tmp_path)
    src = store.create("src", "tiny", kv_dtype=kv, sampler=sampler, options=SessionOptions(commit_every=4))
    full = src.generate(PROMPT, 20).tokens
    n = len(PROMPT) + 6  # records 0..n-1 = prompt + first 6 generated; record n = 7th generated
    src.fork("f", at=n)
    info_full = src.fork("g")  # a fork of everything continues like the source
    src.close()
    assert info_full.tokens == len(PROMPT) + 19
    out = run_child({"root": str(tmp_path), "jobs": [{"id": "f", "max_new": 13},
                                                      {"id": "g", "max_new": 5}]})
    # fork f feeds the source's 7th token and must sample its 8th..20th
    assert out["f"]["tokens"] == full[7:20]
    expected_g = reference_turns(tiny, kv, [(PROMPT, 20), (None, 5)], sampler)[1]
    assert out["g"]["tokens"] == expected_g
    s = SessionStore(tmp_path).open("src")
    assert s.generate(None, 5).tokens == expected_g  # the source is untouched by its forks
    s.close()


def test_resume_verification_catches_damage(tmp_path) -> None:
    store = SessionStore(tmp_path)
    s = store.create("s", "tiny", kv_dtype="fp8", options=SessionOptions(commit_every=64))
    s.generate(PROMPT, 6)
    s.close()
    mpath = store.session_dir("s") / MANIFEST_NAME
    good = read_manifest(mpath)
    # (1) a digest that does not match the recomputed logits
    bad = read_manifest(mpath)
    bad.last_logits.top_values[0] += 1.0
    bad.last_logits = type(bad.last_logits)(bad.last_logits.position, bad.last_logits.top_ids,
                                            bad.last_logits.top_values, "0" * 32)
    write_manifest(mpath, bad)
    with pytest.raises(CorruptionError, match="logits at position"):
        SessionStore(tmp_path).open("s")
    write_manifest(mpath, good)
    # (2) a flipped byte in the last record: the sidecar catches it
    kv = store.kv_path("s")
    raw = bytearray(kv.read_bytes())
    with open_kv(kv) as reader:  # the file may hold a zero-filled stale tail past the records
        rec = reader.record_bytes
    pos = 40 + (good.committed - 1) * rec + 100
    raw[pos] ^= 0x40
    kv.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="checksum"):
        SessionStore(tmp_path).open("s")
    # (3) same damage with no sidecar: recomputing the last record's rows catches it
    (store.session_dir("s") / "kv.coli_kv.colisum").unlink()
    raw[40 + (good.committed - 1) * rec + 4: 40 + good.committed * rec - 8] = bytes(rec - 12)
    kv.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="record"):
        SessionStore(tmp_path).open("s")


def test_other_checkpoint_of_same_shape_is_refused(tmp_path) -> None:
    a = write_tiny_checkpoint(tmp_path / "model-a", seed=1)
    b = write_tiny_checkpoint(tmp_path / "model-b", seed=2)
    store = SessionStore(tmp_path / "store")
    s = store.create("s", a, kv_dtype="fp8")
    s.generate(PROMPT, 3)
    s.close()
    with pytest.raises(ModelMismatchError) as err:
        SessionStore(tmp_path / "store").open("s", b)
    assert "model-a" in str(err.value) and "model-b" in str(err.value)
    s = SessionStore(tmp_path / "store").open("s")  # the manifest knows the model: no --model needed
    assert s.model_ref.name == "model-a"
    s.close()
    json.dumps(store.info("s").to_json())
