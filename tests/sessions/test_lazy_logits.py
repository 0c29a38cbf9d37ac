"""Deferred verification of the last position (``lazy_logits``, FORMAT.md 5.5).

When the sidecar vouched for every committed record, a resume does not recompute the last
position: a turn that feeds tokens never needs its logits, and one that continues with nothing
to feed recomputes and checks it then. Both stay token-exact against the uninterrupted run;
records no sidecar covers, and a manifest that disagrees with the file, still take the recompute
at resume.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sessionstore.sessions.recovery as recovery
import sessionstore.sessions.session_resume as resume_mod
from kernels.errors import CorruptionError
from kernels.model.sampling import Sampler
from sessionstore.sessions import SessionOptions
from sessionstore.sessions.manifest import MANIFEST_NAME, read_manifest, write_manifest
from sessionstore.sessions.recovery import DEFERRED
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turn_loop import reference_turns

PROMPT = list(b"Lazy logits resume")
SAMPLED = Sampler(0.9, 40, 0.95, 77)


@pytest.fixture
def recomputes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every recompute of a last position in the session code, by committed length."""
    calls: list[int] = []
    real = recovery.recompute_last

    def counting(model: Any, blocks_of: Any, tokens: Any, kv_dtype: str, index_rows: Any = None) -> Any:
        calls.append(int(tokens.shape[0]))
        return real(model, blocks_of, tokens, kv_dtype, index_rows)

    monkeypatch.setattr(recovery, "recompute_last", counting)
    monkeypatch.setattr(resume_mod, "recompute_last", counting)
    yield calls


def _make(root: Path, model: str, kv: str, first: tuple[list[int], int]) -> list[int]:
    s = SessionStore(root).create("s", model, kv_dtype=kv, sampler=SAMPLED)
    out = s.generate(*first).tokens
    s.close()
    return out


@pytest.mark.parametrize("kv", ["f32", "fp8", "int4"])
def test_resume_then_new_prompt_never_recomputes(tmp_path, tiny, recomputes, kv) -> None:
    first = _make(tmp_path, "tiny", kv, (PROMPT, 6))
    s = SessionStore(tmp_path).open("s", options=SessionOptions(lazy_logits=True))
    assert s.resume_report["verified"] == DEFERRED
    assert s.resume_report["last_position"] == "deferred" and s.resume_report["not_covered"] == 0
    assert s.resume_report["checksums"] == f"{s.committed} record(s) match their checksums"
    second = PROMPT + first + list(b" and more")
    got = s.generate(second, 5).tokens
    s.close()
    assert recomputes == []  # the resume and the turn: no recompute of the last position
    assert s.resume_report["last_position"] == "deferred"  # the report says what was (not) checked
    assert got == reference_turns(tiny, kv, [(PROMPT, 6), (second, 5)], SAMPLED)[1]
    assert first == reference_turns(tiny, kv, [(PROMPT, 6)], SAMPLED)[0]


def test_resume_then_continue_with_pending_feeds_it_and_never_recomputes(tmp_path, tiny, recomputes) -> None:
    _make(tmp_path, "tiny", "fp8", (PROMPT, 4))
    s = SessionStore(tmp_path).open("s", options=SessionOptions(lazy_logits=True))
    assert s.pending  # the last sampled token, fed first
    got = s.generate(None, 7).tokens
    s.close()
    assert recomputes == []
    assert got == reference_turns(tiny, "fp8", [(PROMPT, 4), (None, 7)], SAMPLED)[1]


@pytest.mark.parametrize("kv", ["f32", "fp8", "int4"])
def test_resume_then_continue_with_nothing_to_feed_recomputes_exactly(tmp_path, tiny, recomputes, kv) -> None:
    assert _make(tmp_path, "tiny", kv, (PROMPT, 0)) == []  # prompt ingested, nothing sampled or pending
    s = SessionStore(tmp_path).open("s", options=SessionOptions(lazy_logits=True))
    assert s.pending == [] and s.resume_report["last_position"] == "deferred"
    n = s.committed
    got = s.generate(None, 6).tokens
    assert recomputes == [n]  # once, when the turn sampled from the last position
    assert s.resume_report["last_position"] == "recomputed"
    assert s.resume_report["verified"] == "bit-identical" and s.resume_report["rows_exact"] is True
    again = s.generate(None, 3).tokens  # the pending token is fed: nothing more to recompute
    s.close()
    assert recomputes == [n]
    want = reference_turns(tiny, kv, [(PROMPT, 0), (None, 6), (None, 3)], SAMPLED)
    assert [got, again] == want[1:]


def test_eager_resume_is_unchanged_by_default(tmp_path, tiny, recomputes) -> None:
    _make(tmp_path, "tiny", "fp8", (PROMPT, 3))
    s = SessionStore(tmp_path).open("s")
    assert s.resume_report["verified"] == "bit-identical" and s.resume_report["last_position"] == "recomputed"
    assert recomputes == [s.committed]
    s.close()


def test_a_wrong_digest_is_caught_when_the_deferred_logits_are_used(tmp_path, tiny, recomputes) -> None:
    _make(tmp_path, "tiny", "fp8", (PROMPT, 0))
    mpath = tmp_path / "sessions" / "s" / MANIFEST_NAME
    bad = read_manifest(mpath)
    assert bad.last_logits is not None
    bad.last_logits = type(bad.last_logits)(bad.last_logits.position, bad.last_logits.top_ids,
                                            [v + 1.0 for v in bad.last_logits.top_values], "0" * 32)
    write_manifest(mpath, bad)
    s = SessionStore(tmp_path).open("s", options=SessionOptions(lazy_logits=True))
    assert s.resume_report["last_position"] == "deferred"
    with pytest.raises(CorruptionError, match=r"session 's'.*logits at position"):
        s.generate(None, 4)
    assert s.state == "suspended"  # released, as a failed resume is: nothing was sampled or written
    with pytest.raises(CorruptionError, match="logits at position"):
        s.generate(None, 4)  # the next use resumes again and fails again
    assert read_manifest(mpath).last_logits == bad.last_logits


def test_records_no_sidecar_covers_are_recomputed_at_resume(tmp_path, tiny, recomputes) -> None:
    _make(tmp_path, "tiny", "fp8", (PROMPT, 3))
    kv = SessionStore(tmp_path).kv_path("s")
    Path(str(kv) + ".colisum").unlink()
    s = SessionStore(tmp_path).open("s", options=SessionOptions(lazy_logits=True))
    report = s.resume_report
    assert report["not_covered"] == s.committed > 0 and report["last_position"] == "recomputed"
    assert "not covered by a sidecar" in report["verified"] and recomputes == [s.committed]
    s.close()


def test_a_manifest_behind_the_file_recovers_at_resume(tmp_path, tiny, recomputes) -> None:
    _make(tmp_path, "tiny", "fp8", (PROMPT, 5))
    mpath = tmp_path / "sessions" / "s" / MANIFEST_NAME
    behind = read_manifest(mpath)
    n = behind.committed
    behind.committed, behind.pending, behind.last_logits = n - 2, [], None
    write_manifest(mpath, behind)
    s = SessionStore(tmp_path).open("s", options=SessionOptions(lazy_logits=True))
    assert s.resume_report["recovered"] is True and recomputes == [n]
    got = s.generate(None, 4).tokens
    s.close()
    assert got == reference_turns(tiny, "fp8", [(PROMPT, 5), (None, 4)], SAMPLED)[1]


def test_glm_dsa_session_defers_and_continues_exactly(tmp_path, tiny_glm_dir, recomputes) -> None:
    from kernels.model import load_model

    model = load_model(str(tiny_glm_dir))
    prompt = [3, 17, 22, 5, 9, 40, 11, 2, 8]
    assert _make(tmp_path, str(tiny_glm_dir), "fp8", (prompt, 0)) == []
    s = SessionStore(tmp_path).open("s", options=SessionOptions(lazy_logits=True))
    assert s.resume_report["last_position"] == "deferred"
    got = s.generate(None, 5).tokens
    s.close()
    assert recomputes == [len(prompt)] and s.resume_report["verified"] == "bit-identical"
    assert got == reference_turns(model, "fp8", [(prompt, 0), (None, 5)], SAMPLED)[1]
