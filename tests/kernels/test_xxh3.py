"""kernels.xxh3 gives exactly the xxhash package's xxh3_64 (the sidecar's checksum, FORMAT.md 4.1)
over every size class of the specification, and hashes without holding the GIL."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.xxh3 import xxh3_64, xxh3_64_rows
from tests.support.gil_probe import probe_while

# every branch of the spec: 0, 1-3, 4-8, 9-16, 17-128 (each 32-byte round count), 129-240 and the
# long path around its stripes (64 B), blocks (1024 B) and the last stripe's overlap
BOUNDARIES = sorted({*range(0, 300), 319, 320, 321, 383, 384, 385, 511, 512, 513, 1023, 1024, 1025,
                     1087, 1088, 1089, 1983, 1984, 1985, 2047, 2048, 2049, 3072, 3073, 46592, 46596})
SEEDS = (0, 1, 2, 255, 4096, 2**32 - 1, 2**32, 123_456_789_012, 2**63 - 1)


@pytest.mark.parametrize("seed", SEEDS)
def test_equals_xxhash_on_every_boundary(seed: int) -> None:
    rng = np.random.default_rng(seed % 1000)
    data = rng.integers(0, 256, max(BOUNDARIES) + 7, dtype=np.uint8)  # [n] u8
    for n in BOUNDARIES:
        for skew in (0, 3):  # an unaligned start too
            piece = data[skew:skew + n]
            assert xxh3_64(piece, seed) == xxhash.xxh3_64_intdigest(piece.tobytes(), seed=seed), (n, skew)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=5000), st.integers(0, 2**63 - 1))
def test_equals_xxhash_any_bytes(data: bytes, seed: int) -> None:
    assert xxh3_64(np.frombuffer(data, np.uint8), seed) == xxhash.xxh3_64_intdigest(data, seed=seed)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(0, 3000), st.integers(0, 2**40), st.integers(0, 2**32 - 1))
def test_rows_equal_xxhash_per_record(k: int, size: int, first: int, salt: int) -> None:
    """Row i seeded with first + i, as the sidecar seeds a record with its position."""
    rows = np.random.default_rng(salt).integers(0, 256, (k, size), dtype=np.uint8)  # [k, size] u8
    want = [xxhash.xxh3_64_intdigest(rows[i].tobytes(), seed=first + i) for i in range(k)]
    assert xxh3_64_rows(rows, first).tolist() == want


def test_rows_refuse_what_they_cannot_hash() -> None:
    with pytest.raises(ValueError):
        xxh3_64_rows(np.zeros((4, 8), dtype=np.uint16))
    with pytest.raises(ValueError):
        xxh3_64_rows(np.zeros((4, 8), dtype=np.uint8)[:, ::2])
    with pytest.raises(ValueError):
        xxh3_64_rows(np.zeros((2, 8), dtype=np.uint8), 2**63 - 1)


def test_hashing_leaves_the_gil_to_other_threads() -> None:
    """A thread hashing 0.5 GB of 45.5 KB records (a GLM-5.2 session's size) in calls of 1024
    records (47 MB, ~4 ms each): a sleeping probe thread wakes on time meanwhile. Were the GIL held
    for a call, as the xxhash binding holds it for a record-sized input, each wake-up would wait for
    the rest of a call (ms). (The median, not the maximum: one scheduler hiccup on a loaded host is
    not the GIL.)"""
    rows = np.random.default_rng(0).integers(0, 256, (1024, 46592), dtype=np.uint8)  # [1024, 46592] u8
    xxh3_64_rows(rows[:1])  # compiled (or loaded from the cache) before anything is timed

    def hash_all() -> None:
        for _ in range(12):
            xxh3_64_rows(rows, 5)

    late = probe_while(threading.Thread(target=hash_all))
    assert len(late) > 20 and float(np.median(late)) < 1e-3, (
        f"{len(late)} wake-ups beside the hashing thread, median {np.median(late) * 1e3:.2f} ms late, "
        f"the latest {max(late) * 1e3:.1f} ms")
