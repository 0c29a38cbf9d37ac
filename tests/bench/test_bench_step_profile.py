"""bench.step_profile's pieces: numba's code named for perf (bench.jit_symbols) and perf's report read
into kernel shares. The profile itself needs Linux perf and is a bench, not a test."""
from __future__ import annotations

from pathlib import Path

from numba import njit

from bench import jit_symbols
from bench.step_profile import shares

jit_symbols.install()


@njit(cache=False)
def _triple(x: int) -> int:
    return 3 * x


def test_a_compiled_function_is_named_at_its_address(tmp_path: Path) -> None:
    assert _triple(5) == 15
    named = jit_symbols.write_perf_map(tmp_path / "perf.map")
    assert named > 0
    cres = next(iter(_triple.overloads.values()))
    address = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    lines = (tmp_path / "perf.map").read_text().splitlines()
    rows = [line.split(maxsplit=2) for line in lines]  # START SIZE NAME: a name may hold spaces
    covering = [name for start, size, name in rows if int(start, 16) <= address < int(start, 16) + int(size, 16)]
    assert "test_bench_step_profile._triple" in covering


def test_short_names_of_numba_symbols() -> None:
    mangled = "_ZN7kernels5model9simd_tile6_tilesB4v100B40c8tJTIeFIjxB2IKSgI4CrvQClQZ6FcpCShpgEU0AEx8UniTuple"
    assert jit_symbols.short_name(mangled) == "simd_tile._tiles"
    assert jit_symbols.short_name("cfunc." + mangled) == "simd_tile._tiles"
    assert jit_symbols.short_name("NRT_decref") == "NRT_decref"


def test_shares_sum_the_interpreter_and_name_the_kernels() -> None:
    report = """# Overhead  Shared Object  Symbol
    39.27%  [JIT] tid 123          [.] panel_tiles._pair
     5.00%  libpython3.11.so.1.0   [.] _PyEval_EvalFrameDefault
     3.80%  libpython3.11.so.1.0   [.] gc_collect_main
     1.71%  libm.so.6              [.] __expf_fma
     0.50%  [kernel.kallsyms]      [k] exc_page_fault
"""
    got = shares(report, 3)
    assert got == [("panel_tiles._pair", 39.27), ("python", 8.8), ("libm.so.6:__expf_fma", 1.71)]
