"""The numba kernels compiled into this checkout's cache once, before a test run's workers start.

The kernels compile when their module is first imported (explicit signatures) or first called (the
compiled step), about 30 s of CPU in all, and numba holds no lock while it compiles: in a fresh clone
both of pytest's workers (each imports the kernels while it collects) and the first servers they
started compiled the same kernels at the same moment, each paying the whole cost. tests/conftest.py
runs :func:`warm_if_cold` in pytest's main process, before the workers exist: the attention tables
compile in one process while the other kernels compile in a second, then one process steps each
model the suite serves, so every later process loads what is cached. A warm cache costs one look at
the ``__pycache__`` folders.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]

# every module of compiled kernels, in two groups that compile side by side (row_tables and the
# attention steps it imports are half the work; the model's kernels the other half)
GROUPS: tuple[tuple[str, ...], ...] = (
    ("kernels.attention.row_tables", "kernels.attention.sparse_step", "kernels.attention.select_step"),
    ("kernels.fp8.row_quantizer", "kernels.tq.libm_kernel", "kernels.model.rowwise", "kernels.model.step_math",
     "kernels.model.moe_step", "kernels.model.once_product", "kernels.model.compiled_moe",
     "kernels.model.f32_row_tables", "kernels.model.tq_row_tables", "kernels.model.compiled_step"),
)
STEPPED = (("glm-mini", "fp8"), ("glm-mini", "f32"), ("tiny", "fp8"))  # (model, kv dtype) a step compiles for


def _module_file(module: str) -> Path:
    return REPO / (module.replace(".", "/") + ".py")


def cold() -> bool:
    """Whether any compiled-kernel module has nothing in numba's cache yet (see kernels.compile_notice)."""
    from kernels.compile_notice import cached

    return not all(cached(str(_module_file(m))) for group in GROUPS for m in group)


def step_each_model() -> None:
    """A prompt and a batched decode step of each ``STEPPED`` model and kv dtype (the lazily compiled
    step's signatures)."""
    from kernels.model import load_model

    for name, kv_dtype in STEPPED:
        model = load_model(name)
        caches = [model.new_cache(kv_dtype), model.new_cache(kv_dtype)]
        model.step(caches, np.array([5, 6, 7, 8, 9], dtype=np.int32), [3, 2])  # two prompts
        model.decode_step(caches, np.array([10, 11], dtype=np.int32))


def warm_if_cold(timeout_s: float = 900.0) -> None:
    """Compile every kernel into the cache when it is cold: the two groups side by side, then the
    steps (after both: a step imports every group). A failure here is left to the tests to meet."""
    if not cold():
        return
    code = "import sys\nfor m in sys.argv[1:]:\n    __import__(m)\n"
    runs = [[sys.executable, "-c", code, *group] for group in GROUPS]
    _run_together(runs, timeout_s)
    _run_together([[sys.executable, "-m", "tests.support.warm_kernels"]], timeout_s)


def _run_together(argvs: list[list[str]], timeout_s: float) -> None:
    procs = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for argv in argvs]
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    step_each_model()
