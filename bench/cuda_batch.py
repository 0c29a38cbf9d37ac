"""The bandwidth bench's batch launch: one decode step of B sessions in ONE launch of the CUDA split
kernel (:func:`batched_decode_device`), each session's query over all of its rows.

Serving never launches this (its step attends layer by layer, session by session:
:mod:`kernels.model`, :func:`kernels.cuda.attention.absorbed_attention_device`); ``bench.attention``
times it against the device's peak bandwidth and the tests hold it to the CPU's attention
(``tests/support/batched_decode.py``). It runs on any ``kernels.cuda.launch.Runner`` (a GPU, or the
CPU emulator in tests).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels.cuda.attention import device_queries, device_rows, row_widths
from kernels.cuda.launch import KERNELS, Runner, run_split_decode
from kernels.cuda.rotation import from_rotated_domain, to_rotated_domain
from kernels.cuda.sources import KernelDims
from kernels.errors import FormatError, ModelMismatchError
from kernels.rows import F32Rows, Fp8Rows, LatentRows, TqRows


def batched_decode_device(
    runner: Runner,
    q_abs: Any,  # [B, H, kv_lora]
    q_rope: Any,  # [B, H, rope]
    caches: Sequence[LatentRows | Sequence[LatentRows]],
    softmax_scale: float,
    *,
    kernel: str = "simt",
    split_rows: int | None = None,
) -> Any:
    """One decode step for B sessions in ONE launch: session b's query attends all of its rows.

    ``caches[b]`` is a block or a list of blocks (different lengths allowed; one row kind for all).
    Returns ctx [B, H, kv_lora] (device).
    """
    if kernel not in KERNELS:
        raise FormatError(f"cuda attention: kernel must be one of {sorted(KERNELS)}, found {kernel!r}")
    sessions = [device_rows(runner, [c] if isinstance(c, (F32Rows, Fp8Rows, TqRows)) else list(c)) for c in caches]
    if not sessions:
        raise FormatError("cuda attention: no sessions given")
    width, rope = row_widths(sessions[0])
    for b, s in enumerate(sessions):
        w = row_widths(s)
        if w != (width, rope):
            raise ModelMismatchError(f"cuda attention: session {b} widths {w} differ from session 0 {(width, rope)}")
    qa, qr = device_queries(runner, q_abs, "q_abs", width), device_queries(runner, q_rope, "q_rope", rope)
    if qa.shape[0] != len(sessions) or qr.shape[:2] != qa.shape[:2]:
        raise FormatError(f"cuda attention: q_abs {qa.shape}/q_rope {qr.shape} need one row per session"
                          f" ({len(sessions)})")
    items = np.zeros((len(sessions), 4), np.int32)
    items[:, 0] = np.arange(len(sessions))
    items[:, 1] = np.arange(len(sessions))
    items[:, 2] = [s.length for s in sessions]
    dims = KernelDims(int(qa.shape[1]), width, rope)
    first = sessions[0]
    if isinstance(first, TqRows):  # one row kind and codec per launch: run_split_decode refuses a mix
        qa, qr = to_rotated_domain(runner, dims, qa, first.codec), to_rotated_domain(runner, dims, qr, first.codec)
        ctx = run_split_decode(runner, dims, kernel, sessions, items, qa, qr, softmax_scale, split_rows)
        return from_rotated_domain(runner, dims, ctx, first.codec)
    return run_split_decode(runner, dims, kernel, sessions, items, qa, qr, softmax_scale, split_rows)
