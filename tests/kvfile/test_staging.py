"""The writer's staging buffer against a plain list of records."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionstore.kvfile.staging import Staging

DTYPE = np.dtype([("token", "<i4"), ("row", "u1", (12,))])  # a small packed record


def batch(start: int, k: int) -> np.ndarray:
    out = np.zeros(k, dtype=DTYPE)  # [k] records
    out["token"] = np.arange(start, start + k)
    out["row"] = (np.arange(start, start + k)[:, None] * 7 + np.arange(12)) % 251
    return out


ops = st.lists(st.one_of(st.tuples(st.just("add"), st.integers(1, 40)),
                         st.tuples(st.just("trim"), st.integers(0, 60)),
                         st.tuples(st.just("write"), st.integers(0, 60)),
                         st.tuples(st.just("entries"), st.integers(0, 60)),
                         st.tuples(st.just("commit"), st.just(0))), max_size=30)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 24), steps=ops)
def test_staging_holds_exactly_the_staged_records(capacity, steps):
    staging, model, next_token = Staging(DTYPE, capacity), [], 0
    for op, k in steps:
        if op == "add":
            staging.add(batch(next_token, k))
            model += list(range(next_token, next_token + k))
            next_token += k
        elif op == "trim":
            staging.trim(k)
            model = model[:k]
        elif op == "write":
            staging.written = min(k, staging.count)
        elif op == "entries":
            staging.entries_written = min(k, staging.count)
        else:
            staging.committed()
            model = []
        assert staging.count == len(model) and staging.written <= staging.count
        assert staging.entries_written <= staging.count
        assert 0 <= staging.full_prefix() <= staging.count
        everything = b"".join(v.tobytes() for v in staging.byte_views(0, staging.count))
        assert everything == b"".join(bytes(batch(t, 1).view(np.uint8)) for t in model)
        if model:  # any sub-range is the slice of the whole
            lo, hi = len(model) // 3, len(model) - len(model) // 4
            part = b"".join(v.tobytes() for v in staging.byte_views(lo, hi))
            assert part == everything[lo * DTYPE.itemsize:hi * DTYPE.itemsize]


def test_a_decode_loop_reuses_one_buffer_and_big_batches_are_not_copied():
    staging = Staging(DTYPE, 64)
    staging.add(batch(0, 1))
    first = staging.byte_views(0, 1)[0].base
    for t in range(1, 50):  # commit after every record: the same owned chunk every time
        staging.committed()
        staging.add(batch(t, 1))
        assert staging.byte_views(0, 1)[0].base is first
    big = batch(100, 40)  # >= capacity / 8: staged as its own chunk, a view of the caller's array
    staging.committed()
    staging.add(big)
    assert np.shares_memory(staging.byte_views(0, 40)[0], big)
