"""The commit state page's payload is written out field by field (a durable stream encodes one
page per session per step): byte for byte the compact, key-sorted JSON of FORMAT.md 5.3.1 that
``json.dumps`` makes, for any fields, and a writer's kept digest JSON follows its digest."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionstore.sessions.commit_state_page import (
    STATE_BYTES,
    STATE_MAGIC,
    STATE_VERSION,
    StateWriter,
    decode_state,
    encode_state,
)
from sessionstore.sessions.digest import LogitsDigest

VOCAB = 1 << 20


@dataclass
class Fields:
    epoch: int
    committed: int
    pending: list[int] = field(default_factory=list)
    last_logits: LogitsDigest | None = None
    updated_at: str = "2026-12-06T10:00:00.000000Z"


def reference_page(f: Fields, seq: int) -> bytes:
    """The page as FORMAT.md 5.3.1 words it, made with json.dumps of the whole object."""
    logits = None if f.last_logits is None else {
        "position": f.last_logits.position, "top_ids": list(f.last_logits.top_ids),
        "top_values": list(f.last_logits.top_values), "hash": f.last_logits.hash}
    payload = json.dumps({"epoch": f.epoch, "committed": f.committed, "pending": f.pending, "last_logits": logits,
                          "updated_at": f.updated_at, "seq": seq},
                         separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    body = struct.pack("<8sII", STATE_MAGIC, STATE_VERSION, len(payload)) + payload
    page = body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    return page + bytes(STATE_BYTES - len(page))


digests = st.none() | st.builds(
    LogitsDigest, st.integers(0, 1 << 40), st.lists(st.integers(0, VOCAB - 1), max_size=8),
    st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), max_size=8),
    st.text(alphabet="0123456789abcdef", min_size=32, max_size=32))
fields = st.builds(Fields, st.integers(0, (1 << 63) - 1), st.integers(0, (1 << 40)),
                   st.lists(st.integers(0, VOCAB - 1), max_size=64), digests, st.text(max_size=40))


@settings(max_examples=150, deadline=None)
@given(fields, st.integers(0, (1 << 63) - 1))
def test_the_page_is_byte_for_byte_json_dumps(f: Fields, seq: int) -> None:
    assert encode_state(f, seq) == reference_page(f, seq)


def test_a_writer_keeps_its_digest_json_only_for_the_same_digest(tmp_path) -> None:
    writer = StateWriter(tmp_path / "manifest.json")
    first = LogitsDigest(7, [1, 2], [0.5, -1.25], "ab" * 16)
    f = Fields(epoch=3, committed=8, pending=[9, 10], last_logits=first)
    for digest in (first, first, LogitsDigest(9, [4], [2.0], "cd" * 16), None, first):
        f.last_logits = digest
        assert writer.encode(f) == reference_page(f, writer.seq)
        writer.write(f)
    assert decode_state(writer.encode(f), VOCAB, "page")["pending"] == [9, 10]
    writer.close()


def test_fields_that_are_not_plain_ints_take_json_s_own_rules() -> None:
    with pytest.raises(TypeError):  # as json.dumps: a numpy integer is no JSON number
        encode_state(Fields(epoch=1, committed=2, pending=[np.int64(5)]))  # type: ignore[list-item]
    odd = Fields(epoch=True, committed=2, pending=[False, 3])  # bools: json writes true / false
    assert encode_state(odd, 4) == reference_page(odd, 4)
