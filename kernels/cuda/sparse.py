"""Sparse (DSA) absorbed attention on the device: each query attends only its selected rows.

Same contract as ``kernels.attention.sparse.sparse_absorbed_attention``: selection [S, k] holds
ascending absolute positions of the cache (query s at position T - S + s may select rows <= it).
The SIMT gather kernels (mla_sparse_simt_*) read those rows by index where they lie: the cache
is never gathered into a copy. f32, fp8 and v3 rows (int4 and PolarQuant, in the rotated domain:
q rotated once before, the context unrotated once after). One work item per query, whose length is k, so
the split planning and the reduce are those of the dense path.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels.attention.absorbed import check_query_pair
from kernels.attention.sparse import check_selection
from kernels.cuda.attention import QUERY_CHUNK, device_queries, device_rows, row_widths
from kernels.cuda.launch import Runner, run_split_decode
from kernels.cuda.rotation import from_rotated_domain, to_rotated_domain
from kernels.cuda.sources import KernelDims
from kernels.errors import LimitError
from kernels.rows import LatentRows, TqRows

MAX_ROWS = (1 << 31) - 1  # selected positions travel as int32


def _host_selection(runner: Runner, selection: Any) -> np.ndarray:
    xp = runner.xp
    if xp is not np and isinstance(selection, xp.ndarray):
        return np.asarray(xp.asnumpy(selection))
    return np.asarray(selection)


def sparse_absorbed_attention_device(
    runner: Runner,
    q_abs: Any,  # [S, H, kv_lora]
    q_rope: Any,  # [S, H, rope]
    blocks: Sequence[LatentRows],
    selection: Any,  # [S, k] ascending absolute positions
    softmax_scale: float,
    *,
    split_rows: int | None = None,
) -> Any:
    """ctx [S, H, kv_lora] f32 (device) of each query over its selected rows (SIMT gather kernel)."""
    rows = device_rows(runner, blocks)
    width, rope = row_widths(rows)
    qa, qr = device_queries(runner, q_abs, "q_abs", width), device_queries(runner, q_rope, "q_rope", rope)
    n_q, heads = check_query_pair("cuda sparse attention", qa, qr)
    if rows.length > MAX_ROWS:
        raise LimitError(f"cuda sparse attention: {rows.length} cache rows exceed {MAX_ROWS} (int32 positions)")
    sel = check_selection(_host_selection(runner, selection), n_q, rows.length)  # sel: [S, k] i64, validated
    k = int(sel.shape[1])
    dims = KernelDims(heads, width, rope)
    codec = rows.codec if isinstance(rows, TqRows) else None
    if codec is not None:
        qa, qr = to_rotated_domain(runner, dims, qa, codec), to_rotated_domain(runner, dims, qr, codec)
    xp = runner.xp
    outs = []
    for s0 in range(0, n_q, QUERY_CHUNK):
        s1 = min(n_q, s0 + QUERY_CHUNK)
        items = np.zeros((s1 - s0, 4), np.int32)  # items: [s, 4] (session, q_row, length = k, 0)
        items[:, 1] = np.arange(s1 - s0)
        items[:, 2] = k
        dev_sel = xp.asarray(np.ascontiguousarray(sel[s0:s1], dtype=np.int32))  # dev_sel: [s, k] i32
        outs.append(run_split_decode(runner, dims, "simt", [rows], items, qa[s0:s1], qr[s0:s1], softmax_scale,
                                     split_rows, sel=dev_sel))
    ctx = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=0)  # ctx: [S, H, kv_lora] f32
    return ctx if codec is None else from_rotated_domain(runner, dims, ctx, codec)
