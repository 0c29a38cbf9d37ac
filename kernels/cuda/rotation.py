"""The v3 rotation on the device (mla_rotate.cu): queries in, context out, of attention over v3 rows.

Attention over v3 rows runs in the rotated domain (kernels.attention.tq): q_abs and q_rope are
rotated once per call and put in the codec's ``rotated_order`` (PolarQuant: bit-reversed, the
order its tiles decode in), the split kernel scores unit-scale values with the row factor
hoisted, and the context is put back in element order and unrotated once. The kernel performs the
same f32 operations in the same order as ``kernels.tq.rotate`` / ``unrotate``, so its results are
bitwise theirs; the reordering is a gather.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kernels.cuda.launch import Runner
from kernels.cuda.sources import KernelDims
from kernels.tq import SIGNS, TqCodec, check_width

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


def to_rotated_domain(runner: Runner, dims: KernelDims, q: Any, codec: TqCodec) -> Any:
    """q [S, H, w] f32 rotated, columns in ``codec.rotated_order(w)`` (as kernels.attention.tq.rotate_queries)."""
    xp = runner.xp
    rq = rotate_device(runner, dims, q)  # rq: [S, H, w] f32
    order = codec.rotated_order(int(q.shape[-1]))
    return rq if order is None else xp.ascontiguousarray(xp.take(rq, xp.asarray(order), axis=-1))


def from_rotated_domain(runner: Runner, dims: KernelDims, ctx: Any, codec: TqCodec) -> Any:
    """The kernel's context [.., kv_lora] (columns in ``rotated_order``) in element order, unrotated."""
    xp = runner.xp
    order = codec.rotated_order(int(ctx.shape[-1]))
    if order is not None:  # elems[..., order] = ctx
        ctx = xp.take(ctx, xp.asarray(np.argsort(order)), axis=-1)
    return rotate_device(runner, dims, ctx, inverse=True)
