"""numpy's float32 arithmetic, bit for bit, in compiled code: what the reference decoder computes
with numpy ufuncs (``np.mean``, ``np.exp``, RMSNorm, LayerNorm, SiLU, RoPE), for the compiled step
(:mod:`kernels.model.compiled_step`) to give the same bits inside one numba call.

- Sums: numpy reduces float32 along a contiguous axis by *pairwise summation*: fewer than 8
  values added in order; up to 128 in eight interleaved accumulators combined
  ``((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))`` then the tail in order; more split in
  two halves (the first a multiple of 8) summed recursively; the reduction adds that sum to
  ``+0.0`` (so a row of one ``-0.0`` sums to ``+0.0``, as numpy gives) (:func:`pairwise_sum`).
- exp: numpy's float32 ``exp`` on x86 with AVX2+FMA3 or AVX512F is its own SIMD routine, not
  libm's ``expf`` (numba's ``np.exp``): on this project's machines they differ in the last bit for
  about 40% of inputs. :func:`exp_f32` is that routine per element: NaN stays NaN, x >= 88.7228..
  gives inf, x <= -103.972.. gives 0; else q = rint(x * log2(e)) (by adding and subtracting
  1.5 * 2^23), r = x + q * c1 + q * c2 (fused multiply-adds, Cody-Waite), a [5/2] rational
  P(r) / Q(r) by fused Horner steps, times 2^q (exact, one rounding where the result is subnormal,
  as AVX512's ``scalef``). :func:`numpy_exp_matches` checks it against ``np.exp`` where the step
  runs (another numpy build or CPU may use libm: the compiled step then does not apply).
- Everything else is one IEEE f32 operation per numpy operation, in numpy's order (numba's strict
  mode: no reassociation, no contraction into FMAs).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.compile_notice import announce_if_cold

_F32 = np.float32
_XMAX = _F32(88.72283935546875)
_XMIN = _F32(-103.97208404541015625)
_MAGIC = _F32(12582912.0)  # 1.5 * 2^23: adding then subtracting it rounds to an integer (ties to even)
_LOG2E = _F32(1.442695040888963407359924681001892137)
_C1 = _F32(-6.93145752e-1)  # -ln 2, high part
_C2 = _F32(-1.42860677e-6)  # -ln 2, low part
_P = tuple(_F32(v) for v in (9.999999999980870924916e-01, 7.257664613233124478488e-01,
                             2.473615434895520810817e-01, 5.114512081637298353406e-02,
                             6.757896990527504603057e-03, 5.082762527590693718096e-04))
_Q = tuple(_F32(v) for v in (1.0, -2.742335390411667452936e-01, 2.159509375685829852307e-02))
_P0, _P1, _P2, _P3, _P4, _P5 = _P
_Q0, _Q1, _Q2 = _Q
_ZERO, _ONE = _F32(0.0), _F32(1.0)


@intrinsic
def _fma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:  # pragma: no cover - compile-time
    """a * b + c rounded once (llvm.fma.f32), float32 operands."""
    if not all(isinstance(t, types.Float) and t.bitwidth == 32 for t in (a, b, c)):
        return None
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        fnty = ir.FunctionType(f32, [f32, f32, f32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.f32")  # type: ignore[no-untyped-call]
        return builder.call(fn, args)

    return sig, codegen


fma_f32: Any = _fma  # (a, b, c) -> a * b + c rounded once, callable from compiled code

announce_if_cold(__file__)  # numba compiles the kernels below now unless cached


@njit(types.float32(types.float32), cache=True, nogil=True)
def exp_f32(x: np.float32) -> np.float32:  # pragma: no cover - compiled
    """numpy's float32 exp (its AVX2/AVX512F routine) of one value."""
    if x != x:
        return x
    if x >= _XMAX:
        return _F32(np.inf)
    if x <= _XMIN:
        return _ZERO
    q = x * _LOG2E
    q = (q + _MAGIC) - _MAGIC
    r = fma_f32(q, _C1, x)
    r = fma_f32(q, _C2, r)
    r = fma_f32(q, _ZERO, r)
    num = fma_f32(_P5, r, _P4)
    num = fma_f32(num, r, _P3)
    num = fma_f32(num, r, _P2)
    num = fma_f32(num, r, _P1)
    num = fma_f32(num, r, _P0)
    den = fma_f32(_Q2, r, _Q1)
    den = fma_f32(den, r, _Q0)
    poly = num / den
    e = int(q)
    if -120 < e < 128:  # a normal 2^e: times it exactly (the power built from its bits)
        scaled: np.float32 = poly * np.uint32((e + 127) << 23).view(np.float32)
        return scaled
    return _F32(math.ldexp(np.float64(poly), e))  # near the ends: one rounding, as scalef


@njit(cache=True, nogil=True, boundscheck=False)
def _block_sum(a: np.ndarray, start: int, n: int) -> np.float32:  # pragma: no cover - compiled
    """numpy's pairwise sum of a[start : start + n] for n <= 128 (float32 accumulators)."""
    if n < 8:
        res = _F32(-0.0)
        for i in range(start, start + n):
            res = res + a[i]
        return res
    r0, r1, r2, r3 = a[start], a[start + 1], a[start + 2], a[start + 3]
    r4, r5, r6, r7 = a[start + 4], a[start + 5], a[start + 6], a[start + 7]
    full = n - n % 8
    for i in range(start + 8, start + full, 8):
        r0 = r0 + a[i]
        r1 = r1 + a[i + 1]
        r2 = r2 + a[i + 2]
        r3 = r3 + a[i + 3]
        r4 = r4 + a[i + 4]
        r5 = r5 + a[i + 5]
        r6 = r6 + a[i + 6]
        r7 = r7 + a[i + 7]
    total: np.float32 = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for i in range(start + full, start + n):
        total = total + a[i]
    return total


STACK = 128  # f32 scratch of pairwise_sum's frames: 32 frames of 4, sums of up to 2**24 values


@njit(cache=True, nogil=True, boundscheck=False)
def pairwise_sum(a: np.ndarray, stack: np.ndarray) -> np.float32:  # pragma: no cover - compiled
    """``np.sum(a, dtype=np.float32)`` of a contiguous float32 vector a [n < 2**24], bitwise.
    ``stack`` [STACK] f32 is scratch: the halving's frames (start, n, phase, left sum), walked
    without recursion (numba's cache cannot link a recursive function into its callers); every
    integer it holds is below 2**24, exact in f32."""
    n = a.shape[0]
    if n <= 128:
        return _ZERO + _block_sum(a, 0, n)
    stack[0], stack[1], stack[2] = 0, n, 0
    top = 0  # the frame on top starts at stack[4 * top]
    ret = _ZERO
    while top >= 0:
        f = 4 * top
        start, size, phase = int(stack[f]), int(stack[f + 1]), int(stack[f + 2])
        if size <= 128:
            ret = _block_sum(a, start, size)
            top -= 1
            continue
        half = size // 2
        half -= half % 8
        if phase == 0:  # the first half
            stack[f + 2] = 1
            top += 1
            stack[f + 4], stack[f + 5], stack[f + 6] = start, half, 0
        elif phase == 1:  # the second half, the first's sum kept
            stack[f + 2], stack[f + 3] = 2, ret
            top += 1
            stack[f + 4], stack[f + 5], stack[f + 6] = start + half, size - half, 0
        else:
            ret = stack[f + 3] + ret
            top -= 1
    return _ZERO + ret


@njit(cache=True, nogil=True, boundscheck=False)
def rms_norm_rows(x: np.ndarray, weight: np.ndarray, eps: np.float32, sq: np.ndarray,
                  out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out [n, D] = weight * (x * (1 / sqrt(mean(x^2) + eps))) per row of x [n, D], as
    :func:`kernels.model.decoder.rms_norm`; ``sq`` [>= D + STACK] f32 is scratch."""
    width = x.shape[1]
    for b in range(x.shape[0]):
        for i in range(width):
            sq[i] = x[b, i] * x[b, i]
        variance = pairwise_sum(sq[:width], sq[width : width + STACK]) / _F32(width)
        inv = _ONE / np.sqrt(variance + eps)
        for i in range(width):
            out[b, i] = weight[i] * (x[b, i] * inv)


@njit(cache=True, nogil=True, boundscheck=False)
def layer_norm_rows(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: np.float32, sq: np.ndarray,
                    out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out [n, D] = (x - mean) / sqrt(var + eps) * weight + bias per row (population variance), as
    :func:`kernels.model.glm_indexer.layer_norm`; ``sq`` [>= D + STACK] f32 is scratch."""
    width = x.shape[1]
    for b in range(x.shape[0]):
        for i in range(width):
            sq[i] = x[b, i]
        mean = pairwise_sum(sq[:width], sq[width : width + STACK]) / _F32(width)
        for i in range(width):
            d = x[b, i] - mean
            sq[i] = d * d
        var = pairwise_sum(sq[:width], sq[width : width + STACK]) / _F32(width)
        inv = _ONE / np.sqrt(var + eps)
        for i in range(width):
            out[b, i] = (x[b, i] - mean) * inv * weight[i] + bias[i]


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def silu_f32(x: np.float32) -> np.float32:  # pragma: no cover - compiled
    """x / (1 + exp(-x)), as :func:`kernels.model.moe.silu`."""
    return x / (_ONE + exp_f32(-x))


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def sigmoid_f32(x: np.float32) -> np.float32:  # pragma: no cover - compiled
    """1 / (1 + exp(-x)), as the router's sigmoid (:func:`kernels.model.moe.route`)."""
    return _ONE / (_ONE + exp_f32(-x))


@njit(cache=True, nogil=True, boundscheck=False)
def rope_into(v: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool,
              out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out [dim] = v [dim] rotated by one position's cos, sin [dim/2], de-interleaved layout, as
    :meth:`kernels.model.rope.Rotary.apply`: pairs (2j, 2j+1) with ``interleave``, else halves."""
    half = cos.shape[0]
    for j in range(half):
        if interleave:
            x1, x2 = v[2 * j], v[2 * j + 1]
        else:
            x1, x2 = v[j], v[half + j]
        out[j] = x1 * cos[j] - x2 * sin[j]
        out[half + j] = x2 * cos[j] + x1 * sin[j]


def numpy_exp_matches() -> bool:
    """Whether :func:`exp_f32` gives numpy's ``np.exp`` bits here, over values from -110 to 90
    and numpy's special cases (numpy picks its routine by CPU; without AVX2+FMA3 it uses libm)."""
    grid = np.linspace(-110, 90, 20011, dtype=np.float32)  # grid: [20011] f32
    rng = np.random.default_rng(36)
    x = np.concatenate([grid, rng.standard_normal(4096).astype(np.float32) * 8,
                        np.array([0.0, -0.0, np.inf, -np.inf, 88.72283, -103.97208, 1e-30], np.float32)])
    with np.errstate(over="ignore"):
        want = np.exp(x)  # want: [n] f32
    got = _exp_all(x)
    return bool(np.array_equal(want.view(np.uint32), got.view(np.uint32)))


@njit(cache=True, nogil=True, boundscheck=False)
def _exp_all(x: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = exp_f32(x[i])
    return out


def exp_rows(x: np.ndarray) -> np.ndarray:
    """:func:`exp_f32` of every element of a float32 array (a test's window on the compiled exp)."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    return _exp_all(flat).reshape(np.shape(x))


def mean_rows(x: np.ndarray) -> np.ndarray:
    """Each row's compiled mean (:func:`pairwise_sum` / D) of x [n, D] f32 -> [n] f32 (a test's
    window on the compiled sum, against ``np.mean(x, axis=-1, dtype=np.float32)``)."""
    xs = np.ascontiguousarray(x, dtype=np.float32)
    return _means(xs)


@njit(cache=True, nogil=True, boundscheck=False)
def _means(x: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    out = np.empty(x.shape[0], np.float32)
    stack = np.empty(STACK, np.float32)
    for b in range(x.shape[0]):
        out[b] = pairwise_sum(x[b], stack) / _F32(x.shape[1])
    return out


__all__ = ["STACK", "exp_f32", "exp_rows", "fma_f32", "layer_norm_rows", "mean_rows", "numpy_exp_matches",
           "pairwise_sum", "rms_norm_rows", "rope_into", "sigmoid_f32", "silu_f32"]
