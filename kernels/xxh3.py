"""XXH3-64 (seeded) compiled with the GIL released: the sidecar's record checksum (FORMAT.md 4.1)
hashed on a thread without stopping the process's other threads.

The ``xxhash`` binding keeps the GIL for an input under about 100 KB (a record: 45.5 KB at GLM-5.2's
dims), and a loop of its calls keeps it between calls, so a server thread that hashed a session's
records stalled every other thread of its process for the whole pass. :func:`xxh3_64_rows` hashes
a whole range of records in one compiled call that holds no GIL (``nogil=True``).

Written from the XXH3 specification (Cyan4973/xxHash, doc/xxhash_spec.md, "XXH3 Algorithm
Description"): the default 192-byte secret, the secret derived from the seed for inputs over 240
bytes, the 0 / 1-3 / 4-8 / 9-16 / 17-128 / 129-240 byte cases and the striped long loop (16 stripes of
64 bytes a block, a scramble after each block, the last stripe at the input's end). It must give
exactly ``xxhash.xxh3_64_intdigest(data, seed)``: tests/kernels/test_xxh3.py compares the two
bit for bit over every size class and the block and stripe boundaries.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

assert sys.byteorder == "little", "the compiled loads read words in the host's order"

U64 = np.uint64
M32 = U64(0xFFFFFFFF)
PRIME32_1 = U64(0x9E3779B1)
PRIME32_2 = U64(0x85EBCA77)
PRIME32_3 = U64(0xC2B2AE3D)
PRIME64_1 = U64(0x9E3779B185EBCA87)
PRIME64_2 = U64(0xC2B2AE3D27D4EB4F)
PRIME64_3 = U64(0x165667B19E3779F9)
PRIME64_4 = U64(0x85EBCA77C2B2AE63)
PRIME64_5 = U64(0x27D4EB2F165667C5)
PRIME_MX1 = U64(0x165667919E3779F9)
PRIME_MX2 = U64(0x9FB21C651E98DF25)

SECRET_SIZE = 192
STRIPE = 64
STRIPES_PER_BLOCK = (SECRET_SIZE - STRIPE) // 8  # 16
BLOCK = STRIPE * STRIPES_PER_BLOCK  # 1024 bytes
MIDSIZE_MAX = 240

DEFAULT_SECRET = np.array([  # [192] u8, the specification's default secret
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
], dtype=np.uint8)
assert DEFAULT_SECRET.shape == (SECRET_SIZE,)
DEFAULT_WORDS = DEFAULT_SECRET.view("<u8").copy()  # [24] u64: the secret as the long path derives it


def _load(width: int) -> Callable[[np.ndarray, int], np.uint64]:
    """An intrinsic that loads the little-endian ``width``-bit word at byte ``p`` of ``a`` [n] u8
    (any alignment: one unaligned load, the host being little-endian), widened to u64."""

    @intrinsic
    def load(typingctx: Any, a: Any, p: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            at = builder.gep(ary.data, [args[1]])  # i8* to byte p
            word_type = context.get_value_type(types.uint64 if width == 64 else types.uint32)
            word = builder.load(builder.bitcast(at, word_type.as_pointer()), align=1)
            return word if width == 64 else builder.zext(word, context.get_value_type(types.uint64))

        return types.uint64(a, p), codegen

    return cast(Callable[[np.ndarray, int], np.uint64], load)


_r64 = _load(64)
_r32 = _load(32)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _rotl(x: np.uint64, r: int) -> np.uint64:
    return (x << U64(r)) | (x >> U64(64 - r))


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _bswap64(x: np.uint64) -> np.uint64:
    v = U64(0)
    for i in range(8):
        v = (v << U64(8)) | ((x >> U64(8 * i)) & U64(0xFF))
    return v


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _bswap32(x: np.uint64) -> np.uint64:
    return (((x & U64(0xFF)) << U64(24)) | ((x & U64(0xFF00)) << U64(8))
            | ((x >> U64(8)) & U64(0xFF00)) | ((x >> U64(24)) & U64(0xFF)))


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _fold128(a: np.uint64, b: np.uint64) -> np.uint64:
    """The 128-bit product a * b, its low and high halves xored (from four 32x32 products)."""
    a_lo, a_hi = a & M32, a >> U64(32)
    b_lo, b_hi = b & M32, b >> U64(32)
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    lo_hi = a_lo * b_hi
    cross = (lo_lo >> U64(32)) + (hi_lo & M32) + lo_hi
    upper = (hi_lo >> U64(32)) + (cross >> U64(32)) + a_hi * b_hi
    lower = (cross << U64(32)) | (lo_lo & M32)
    return lower ^ upper


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _avalanche(x: np.uint64) -> np.uint64:
    x ^= x >> U64(37)
    x *= PRIME_MX1
    return x ^ (x >> U64(32))


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _avalanche64(x: np.uint64) -> np.uint64:
    x ^= x >> U64(33)
    x *= PRIME64_2
    x ^= x >> U64(29)
    x *= PRIME64_3
    return x ^ (x >> U64(32))


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _mix16(d: np.ndarray, p: int, s: np.ndarray, q: int, seed: np.uint64) -> np.uint64:
    """mixStep: 16 bytes of ``d`` at ``p`` with 16 bytes of secret ``s`` at ``q``."""
    return _fold128(_r64(d, p) ^ (_r64(s, q) + seed), _r64(d, p + 8) ^ (_r64(s, q + 8) - seed))


@njit(cache=True, nogil=True, boundscheck=False)
def _short(d: np.ndarray, p: int, n: int, seed: np.uint64, s: np.ndarray) -> np.uint64:
    """Inputs of 0-240 bytes: ``d`` [p, p + n) with the default secret ``s`` [192] u8."""
    if n == 0:
        return _avalanche64(seed ^ _r64(s, 56) ^ _r64(s, 64))
    if n <= 3:
        combined = (U64(d[p + n - 1]) | (U64(n) << U64(8)) | (U64(d[p]) << U64(16))
                    | (U64(d[p + (n >> 1)]) << U64(24)))
        return _avalanche64(((_r32(s, 0) ^ _r32(s, 4)) + seed) ^ combined)
    if n <= 8:
        modified = seed ^ (_bswap32(seed & M32) << U64(32))
        combined = _r32(d, p + n - 4) | (_r32(d, p) << U64(32))
        v = ((_r64(s, 8) ^ _r64(s, 16)) - modified) ^ combined
        v ^= _rotl(v, 49) ^ _rotl(v, 24)
        v *= PRIME_MX2
        v ^= (v >> U64(35)) + U64(n)
        v *= PRIME_MX2
        return v ^ (v >> U64(28))
    if n <= 16:
        low = ((_r64(s, 24) ^ _r64(s, 32)) + seed) ^ _r64(d, p)
        high = ((_r64(s, 40) ^ _r64(s, 48)) - seed) ^ _r64(d, p + n - 8)
        return _avalanche(U64(n) + _bswap64(low) + high + _fold128(low, high))
    acc = U64(n) * PRIME64_1
    if n <= 128:
        for i in range(((n - 1) >> 5) + 1):
            acc += _mix16(d, p + 16 * i, s, 32 * i, seed)
            acc += _mix16(d, p + n - 16 * i - 16, s, 32 * i + 16, seed)
        return _avalanche(acc)
    for i in range(8):
        acc += _mix16(d, p + 16 * i, s, 16 * i, seed)
    acc = _avalanche(acc)
    for i in range(8, n >> 4):
        acc += _mix16(d, p + 16 * i, s, 16 * (i - 8) + 3, seed)
    acc += _mix16(d, p + n - 16, s, 119, seed)
    return _avalanche(acc)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _mulkey(d: np.ndarray, p: int, s: np.ndarray, q: int) -> np.uint64:
    """One lane's product: the data word at ``p`` xored with the secret's at ``q``, its low half times its high."""
    key = _r64(d, p) ^ _r64(s, q)
    return (key & M32) * (key >> U64(32))


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _stripes(acc: np.ndarray, d: np.ndarray, p: int, count: int, s: np.ndarray, q: int) -> None:
    """``count`` 64-byte stripes of ``d`` from ``p`` into ``acc`` [8] u64, stripe k with the secret
    at ``q + 8 k``: lane i's word is added to lane i ^ 1, its keyed product to lane i (the sums
    kept in registers across the stripes)."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]
    for k in range(count):
        x, y = p + STRIPE * k, q + 8 * k
        a0 += _r64(d, x + 8) + _mulkey(d, x, s, y)
        a1 += _r64(d, x) + _mulkey(d, x + 8, s, y + 8)
        a2 += _r64(d, x + 24) + _mulkey(d, x + 16, s, y + 16)
        a3 += _r64(d, x + 16) + _mulkey(d, x + 24, s, y + 24)
        a4 += _r64(d, x + 40) + _mulkey(d, x + 32, s, y + 32)
        a5 += _r64(d, x + 32) + _mulkey(d, x + 40, s, y + 40)
        a6 += _r64(d, x + 56) + _mulkey(d, x + 48, s, y + 48)
        a7 += _r64(d, x + 48) + _mulkey(d, x + 56, s, y + 56)
    acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7] = a0, a1, a2, a3, a4, a5, a6, a7


@njit(cache=True, nogil=True, boundscheck=False)
def _long(d: np.ndarray, p: int, n: int, s: np.ndarray, acc: np.ndarray) -> np.uint64:
    """Inputs over 240 bytes: ``d`` [p, p + n) with secret ``s`` [192] u8 (derived from the seed);
    ``acc`` [8] u64 is scratch."""
    acc[0], acc[1], acc[2], acc[3] = PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3
    acc[4], acc[5], acc[6], acc[7] = PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1
    blocks = (n - 1) // BLOCK
    for b in range(blocks):
        base = p + b * BLOCK
        _stripes(acc, d, base, STRIPES_PER_BLOCK, s, 0)
        for i in range(8):  # scramble with the secret's last 64 bytes
            a = acc[i]
            a ^= a >> U64(47)
            a ^= _r64(s, SECRET_SIZE - STRIPE + 8 * i)
            acc[i] = a * PRIME32_1
    base = p + blocks * BLOCK
    _stripes(acc, d, base, (n - blocks * BLOCK - 1) // STRIPE, s, 0)
    _stripes(acc, d, p + n - STRIPE, 1, s, SECRET_SIZE - STRIPE - 7)  # the last 64 bytes
    result = U64(n) * PRIME64_1
    for i in range(4):
        result += _fold128(acc[2 * i] ^ _r64(s, 11 + 16 * i), acc[2 * i + 1] ^ _r64(s, 11 + 16 * i + 8))
    return _avalanche(result)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _derive(words: np.ndarray, seed: np.uint64, out: np.ndarray) -> None:
    """The long path's secret for ``seed``: ``words`` [24] u64 (the default), pairs +seed / -seed,
    written little-endian into ``out`` [192] u8."""
    for i in range(24):
        w = words[i] + seed if i % 2 == 0 else words[i] - seed
        for j in range(8):
            out[8 * i + j] = np.uint8((w >> U64(8 * j)) & U64(0xFF))


@njit(cache=True, nogil=True, boundscheck=False)
def _hash_one(d: np.ndarray, p: int, n: int, seed: np.uint64, secret: np.ndarray, words: np.ndarray,
              derived: np.ndarray, acc: np.ndarray) -> np.uint64:
    if n <= MIDSIZE_MAX:
        return _short(d, p, n, seed, secret)
    if seed == U64(0):
        return _long(d, p, n, secret, acc)
    _derive(words, seed, derived)
    return _long(d, p, n, derived, acc)


@njit(cache=True, nogil=True, boundscheck=False)
def _rows(flat: np.ndarray, k: int, size: int, first_seed: int, secret: np.ndarray, words: np.ndarray,
          out: np.ndarray) -> None:
    """``out`` [k] u64 = xxh3_64 of each ``size``-byte row of ``flat`` [k * size] u8, row i seeded
    with ``first_seed + i``."""
    derived = np.empty(SECRET_SIZE, dtype=np.uint8)  # [192] u8
    acc = np.empty(8, dtype=np.uint64)  # [8] u64
    for i in range(k):
        out[i] = _hash_one(flat, i * size, size, U64(first_seed + i), secret, words, derived, acc)


def xxh3_64_rows(rows: np.ndarray, first_seed: int = 0) -> np.ndarray:
    """xxh3_64 of each row of ``rows`` [k, size] u8 (C-contiguous), row i seeded with
    ``first_seed + i``: [k] <u8, equal to ``xxhash.xxh3_64_intdigest(rows[i], seed=first_seed + i)``.
    Runs without the GIL (other threads of the process go on meanwhile)."""
    if rows.ndim != 2 or rows.dtype != np.uint8 or not rows.flags.c_contiguous:
        raise ValueError(f"rows must be a C-contiguous [k, size] u8 array, not {rows.dtype} {rows.shape}")
    if first_seed < 0 or first_seed + rows.shape[0] > 1 << 63:
        raise ValueError(f"seeds must lie in [0, 2**63): first {first_seed}, {rows.shape[0]} rows")
    k, size = rows.shape
    out = np.empty(k, dtype="<u8")  # [k] u64
    _rows(rows.reshape(-1), k, size, first_seed, DEFAULT_SECRET, DEFAULT_WORDS, out)
    return out


def xxh3_64(data: np.ndarray, seed: int = 0) -> int:
    """xxh3_64 of ``data`` [n] u8 (contiguous) seeded with ``seed`` in [0, 2**63), without the GIL."""
    return int(xxh3_64_rows(np.ascontiguousarray(data, dtype=np.uint8).reshape(1, -1), seed)[0])


__all__ = ["DEFAULT_SECRET", "xxh3_64", "xxh3_64_rows"]
