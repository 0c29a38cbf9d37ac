"""A mapping made with ``populate`` has its page tables filled by the mmap call (MAP_POPULATE): the
process's resident file pages grow by the mapping's size before a byte of it is touched, and it reads
the same bytes as a plain mapping (a resume's vouching reader is made so: it hashes every record next)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from sessionstore.kvfile.mapping import POPULATE, FileMapping

SIZE = 16 << 20


def rss_file_bytes() -> int:
    """This process's resident file-backed pages (``RssFile`` of /proc/self/status), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile line")


@pytest.mark.skipif(not POPULATE or not os.path.exists("/proc/self/status"), reason="Linux's MAP_POPULATE")
def test_a_populated_mapping_is_resident_before_it_is_read_and_reads_the_same_bytes(tmp_path: Path) -> None:
    data = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)  # [SIZE] u8
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())  # in the page cache now
    fd = os.open(path, os.O_RDONLY)
    try:
        before = rss_file_bytes()
        plain = FileMapping(fd, SIZE)
        after_plain = rss_file_bytes()
        populated = FileMapping(fd, SIZE, populate=True)
        after_populated = rss_file_bytes()
        assert after_plain - before < SIZE // 4, (before, after_plain)  # a plain mapping maps pages as touched
        assert after_populated - after_plain >= SIZE * 9 // 10, (after_plain, after_populated)
        assert np.array_equal(np.frombuffer(populated.buffer, np.uint8), data)
        assert np.array_equal(np.frombuffer(plain.buffer, np.uint8), data)
    finally:
        os.close(fd)
