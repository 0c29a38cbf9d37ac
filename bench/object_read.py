"""The baseline the fleet benches divide by: an object of the store read front to back, as a pull
reads a bundle (``bench.scale``'s restore and ``bench.ship_measure``'s takeover both time it)."""
from __future__ import annotations

READ_PIECE = 4 << 20  # the raw read's pieces


def raw_read(url: str) -> int:
    """Read the object at ``url`` front to back the way a pull reads a bundle; its bytes."""
    from sessionstore.migration import open_source

    total = 0
    with open_source(url) as src:
        while chunk := src.read(READ_PIECE):
            total += len(chunk)
    return total
