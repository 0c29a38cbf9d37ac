"""The usable-scale rule of ``.coli_kv`` v2 rows (FORMAT.md section 2), the one home of its bound.

Apart from the row quantizer (:mod:`.row_quantizer`, compiled), so that a reader that only checks
scales (every file open) loads no compiled kernel.
"""
from __future__ import annotations

from typing import Any

import numpy as np

# The engine's 3.4e38f, the one home of this bound: a row whose amax is larger is a zero row, and a
# stored scale is usable only when > 0 and below it (else the row is inert and reads as 0).
USABLE_SCALE_BOUND = np.float32(3.4e38)


def usable_scales(scales: Any) -> Any:
    """The engine's test for a v2 row scale, the one mask every reader applies: 0 < scale <
    3.4e38f (NaN and inf fail it). ``scales``: a numpy or cupy array; returns its bool mask."""
    return (scales > 0) & (scales < USABLE_SCALE_BOUND)


__all__ = ["USABLE_SCALE_BOUND", "usable_scales"]
