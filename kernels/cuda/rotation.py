"""The v3 rotation on the device (mla_rotate.cu): queries in, context out, of attention over int4 rows.

Attention over v3 int4 rows runs in the rotated domain (kernels.attention.tq): q_abs and q_rope
are rotated once per call, the split kernel scores unit-scale levels with the row factor hoisted,
and the context is unrotated once. The kernel performs the same f32 operations in the same order
as ``kernels.tq.rotate`` / ``unrotate``, so its results are bitwise theirs.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kernels.cuda.launch import Runner
from kernels.cuda.sources import KernelDims
from kernels.tq import SIGNS, check_width

ROTATE_THREADS = 128


def rotate_device(runner: Runner, dims: KernelDims, x: Any, *, inverse: bool = False) -> Any:
    """rotate (or, ``inverse``, unrotate) the last axis of x [..., n] f32 (n a power of two <= 512) -> new array."""
    xp = runner.xp
    n = check_width(int(x.shape[-1]), "rotated")
    src = xp.ascontiguousarray(x, dtype=xp.float32)  # src: [..., n] f32
    out = xp.empty_like(src)  # out: [..., n] f32
    rows = int(src.size // n)
    if rows:
        inv_sqrt_n = np.float32(1.0) / np.sqrt(np.float32(n))  # the f32 factor kernels.tq.fwht multiplies by
        runner.launch(dims, "mla_tq_rotate", (rows, 1, 1), ROTATE_THREADS,
                      (src, out, xp.asarray(SIGNS[:n]), inv_sqrt_n, np.int32(n), np.int32(inverse)))
    return out
