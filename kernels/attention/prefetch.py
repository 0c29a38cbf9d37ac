"""Software prefetch: ask for a span's cache lines before they are read.

A decode step's attention reads each session's selected rows: k positions scattered over that
session's cache (megabytes across a batch, past the core's L2). Read one row after another, each
row's decode waits for its own miss (an out-of-order core holds about one row's work ahead), so
the misses add up: 32 random 80-byte rows of a 7 MB cache took 3.3-4.0 us to decode that way and
1.6-2.0 us with every row's lines asked for first (this VM; BENCHMARKS.md, session 29). A
prefetch is a hint: it reads nothing into the program, never faults (any address may be given),
and changes no value.
"""
from __future__ import annotations

from typing import Any

from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.compile_notice import announce_if_cold

LINE = 64  # bytes of a cache line


def _prefetch(typingctx: Any, address: Any) -> Any:  # pragma: no cover - compile-time
    """``llvm.prefetch`` of the byte at ``address`` (an int): a read, kept close (locality 3), data."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32, ptr = ir.IntType(32), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [ptr, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")  # type: ignore[no-untyped-call]
        builder.call(fn, [builder.inttoptr(args[0], ptr), ir.Constant(i32, 0), ir.Constant(i32, 3),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(address), codegen


prefetch: Any = intrinsic(_prefetch)  # njit-callable: prefetch(address)

announce_if_cold(__file__)  # numba compiles the kernels below now unless cached


@njit(cache=True, nogil=True, inline="always")
def prefetch_span(address: int, nbytes: int) -> None:  # pragma: no cover - compiled
    """Every cache line of the ``nbytes`` bytes from ``address`` asked for (none when ``nbytes`` <= 0)."""
    if nbytes <= 0:
        return
    for offset in range(0, nbytes, LINE):
        prefetch(address + offset)
    prefetch(address + nbytes - 1)


__all__ = ["LINE", "prefetch", "prefetch_span"]
