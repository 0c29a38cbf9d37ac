"""Device entry point of the CUDA attention: the CPU signature (``absorbed_attention_device``), and
the steps it is made of (one session's rows and queries on the device).

It runs on any ``kernels.cuda.launch.Runner`` (a GPU through cupy, or the CPU
emulator in tests). Blocks may hold numpy arrays (uploaded) or device arrays (used in place
when their layout allows: any row stride that is a multiple of 4 bytes, e.g. a record array).
Several blocks of one session are concatenated on the device first.

Kernels: "simt" (default; f32 arithmetic, f32, fp8 and v3 int4 rows: agrees with the CPU to f32
rounding), "mma" (tensor cores, fp8 rows, hi/lo f16 split: f32-like), "mma_fast" (tensor cores,
single f16 operands: ~1e-3 relative; the bandwidth benchmark's kernel).
v3 rows (TqRows: int4, tag 0x104, and PolarQuant, bits 2..6; "simt" only) are attended in the
rotated domain: q rotated once on the device before the split kernel, the context unrotated once
after (kernels.cuda.rotation).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels.attention.absorbed import check_query_pair, query_positions
from kernels.attention.tiles import cache_shape
from kernels.cuda.launch import DeviceRows, Runner, run_split_decode
from kernels.cuda.rotation import from_rotated_domain, to_rotated_domain
from kernels.cuda.sources import KernelDims
from kernels.errors import FormatError, ModelMismatchError
from kernels.rows import F32Rows, Fp8Rows, LatentRows, TqRows

QUERY_CHUNK = 1024  # queries per launch: partials stay <= 1024 x H x kv_lora x 4 B per split


def _device_field(runner: Runner, dev: Any, align: int = 4) -> Any:
    """A device field as the kernels can read it in place (``align``-byte aligned rows/scales), else a copy."""
    ok = dev.strides[-1] == dev.itemsize if dev.ndim == 2 else True
    ok = ok and all(st % align == 0 for st in dev.strides[:1]) and runner.address(dev) % align == 0
    return dev if ok else runner.xp.ascontiguousarray(dev)


def _as_host_or_device(runner: Runner, blk: LatentRows) -> LatentRows:
    """numpy fields of a block are uploaded; device fields stay (validated by cache_shape)."""
    xp = runner.xp
    if xp is np or not isinstance(blk, (F32Rows, Fp8Rows, TqRows)):
        return blk
    up = {k: (xp.asarray(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v) for k, v in vars(blk).items()}
    return type(blk)(**up)


def _tq_device_rows(runner: Runner, host: list[LatentRows]) -> TqRows:
    """v3 blocks of one session (validated by cache_shape: one codec) as ONE device block."""
    xp = runner.xp
    first = host[0]
    assert isinstance(first, TqRows)
    fields = ("lc_codes", "lc_radius", "rc_codes", "rc_radius")
    parts = {f: [_device_field(runner, getattr(b, f), 1 if f.endswith("codes") else 4) for b in host]
             for f in fields}  # codes are read byte by byte, radii as f32
    merged = {f: (v[0] if len(v) == 1 else xp.concatenate(v)) for f, v in parts.items()}
    return TqRows(**merged, codec=first.codec, kv_lora=first.kv_lora, qk_rope=first.qk_rope)


def device_rows(runner: Runner, blocks: Sequence[LatentRows]) -> DeviceRows:
    """One session's blocks as ONE device block (zero copy for a single, suitably aligned block)."""
    xp = runner.xp
    host = [_as_host_or_device(runner, b) for b in blocks]
    shape = cache_shape(host, xp.ndarray)
    if shape.tq is not None:
        return _tq_device_rows(runner, host)
    if not shape.any_fp8 or shape.all_fp8:
        fields = ("lc_codes", "lc_scale", "rc_codes", "rc_scale") if shape.all_fp8 else ("lc", "rc")
        parts = {f: [_device_field(runner, getattr(b, f)) for b in host] for f in fields}
        merged = {f: (v[0] if len(v) == 1 else xp.concatenate(v)) for f, v in parts.items()}
        return Fp8Rows(**merged) if shape.all_fp8 else F32Rows(**merged)
    raise FormatError("cuda attention: a session's blocks must all be f32 or all fp8 (mixed kinds: use the CPU)")


def row_widths(rows: DeviceRows) -> tuple[int, int]:
    """(kv_lora, rope) of a device block."""
    if isinstance(rows, TqRows):
        return rows.kv_lora, rows.qk_rope
    if isinstance(rows, Fp8Rows):
        return int(rows.lc_codes.shape[1]), int(rows.rc_codes.shape[1])
    return int(rows.lc.shape[1]), int(rows.rc.shape[1])


def device_queries(runner: Runner, q: Any, name: str, width: int) -> Any:
    xp = runner.xp
    dev = xp.ascontiguousarray(xp.asarray(q), dtype=xp.float32)
    if dev.ndim != 3 or dev.shape[2] != width:
        raise ModelMismatchError(f"cuda attention: {name} {tuple(dev.shape)} expected [S, H, {width}]")
    return dev


def absorbed_attention_device(
    runner: Runner,
    q_abs: Any,
    q_rope: Any,
    blocks: Sequence[LatentRows],
    softmax_scale: float,
    *,
    causal: bool = True,
    kernel: str = "simt",
    split_rows: int | None = None,
) -> Any:
    """Same contract as kernels.attention.absorbed_attention; returns a device array [S, H, kv_lora]."""
    rows = device_rows(runner, blocks)
    width, rope = row_widths(rows)
    length = rows.length
    qa, qr = device_queries(runner, q_abs, "q_abs", width), device_queries(runner, q_rope, "q_rope", rope)
    n_q, heads = check_query_pair("cuda attention", qa, qr)
    first = query_positions(n_q, length, causal)
    dims = KernelDims(heads, width, rope)
    codec = rows.codec if isinstance(rows, TqRows) else None
    if codec is not None:  # the rotated domain: q once here, the context once at the end
        qa, qr = to_rotated_domain(runner, dims, qa, codec), to_rotated_domain(runner, dims, qr, codec)
    outs = []
    for s0 in range(0, n_q, QUERY_CHUNK):  # bounded partials and grid.y
        s1 = min(n_q, s0 + QUERY_CHUNK)
        items = np.zeros((s1 - s0, 4), np.int32)  # items: [s, 4] (session, q_row, length, 0)
        items[:, 1] = np.arange(s1 - s0)
        items[:, 2] = first + np.arange(s0, s1) + 1 if causal else length
        outs.append(run_split_decode(runner, dims, kernel, [rows], items, qa[s0:s1], qr[s0:s1], softmax_scale,
                                     split_rows))
    ctx = outs[0] if len(outs) == 1 else runner.xp.concatenate(outs, axis=0)  # ctx: [S, H, kv_lora] f32
    return ctx if codec is None else from_rotated_domain(runner, dims, ctx, codec)
