"""kernels.backend: the CPU backend's entry points, and a CUDA request that cannot be served
(no cupy, or no device) giving our error with the install hint; cupy stays optional."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kernels import backend as backend_mod
from kernels.attention import absorbed_attention, mla_attention
from kernels.backend import CpuBackend, get_backend
from kernels.errors import BackendUnavailableError, FormatError
from kernels.rows import F32Rows
from tests.kernels.attention_cases import latent_rows, quantize, queries, split_rows
from tests.support.batched_decode import batched_decode
from tests.support.extras import needs_cuda_extra


def test_cpu_backend_entry_points_are_the_numpy_kernels() -> None:
    rng = np.random.default_rng(0)
    be = get_backend("cpu")
    assert isinstance(be, CpuBackend) and be.name == "cpu"
    lc, rc = latent_rows(rng, 120, 64, 16)
    fp8 = quantize(lc, rc)
    qa, qr = queries(rng, 3, 4, 64), queries(rng, 3, 4, 16)
    assert np.array_equal(be.absorbed_attention(qa, qr, [fp8.rows], 0.1), absorbed_attention(qa, qr, [fp8.rows], 0.1))
    w_uk, w_uv = rng.standard_normal((4, 8, 64)).astype(np.float32), rng.standard_normal((4, 6, 64)).astype(np.float32)
    qn = queries(rng, 3, 4, 8)
    assert np.array_equal(be.mla_attention(qn, qr, [fp8.rows], w_uk, w_uv, 0.1),
                          mla_attention(qn, qr, [fp8.rows], w_uk, w_uv, 0.1))


def test_cpu_batched_decode_is_one_step_per_session() -> None:
    rng = np.random.default_rng(1)
    caches = [quantize(*latent_rows(rng, n, 64, 16)).rows for n in (1, 50, 300)]
    caches[2] = split_rows(caches[2], [100])
    qa, qr = queries(rng, 3, 4, 64), queries(rng, 3, 4, 16)
    got = batched_decode(get_backend("cpu"), qa, qr, caches, 0.1)
    assert got.shape == (3, 4, 64)
    for b, cache in enumerate(caches):
        blocks = cache if isinstance(cache, list) else [cache]
        assert np.array_equal(got[b : b + 1], absorbed_attention(qa[b : b + 1], qr[b : b + 1], blocks, 0.1))
    with pytest.raises(FormatError, match="2 queries for 3 sessions"):
        batched_decode(get_backend("cpu"), qa[:2], qr[:2], caches, 0.1)


def test_unknown_backend_name() -> None:
    with pytest.raises(BackendUnavailableError, match="unknown backend 'tpu'"):
        get_backend("tpu")


@needs_cuda_extra
def test_cuda_without_a_device_raises_our_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from cupy.cuda import runtime

    from kernels.cuda import device

    def no_device() -> int:
        raise runtime.CUDARuntimeError(100)  # cudaErrorNoDevice

    monkeypatch.setattr(runtime, "getDeviceCount", no_device)
    monkeypatch.setattr(device, "get_runner", device.CupyRunner)  # a runner made now, as a process's first
    # call makes it (not one an earlier test left)
    with pytest.raises(BackendUnavailableError, match="no usable CUDA device"):
        get_backend("cuda")
    assert device.cuda_status()[0] is False
    assert backend_mod.get_backend("cpu").name == "cpu"  # the CPU is unaffected


def test_without_cupy_everything_imports_and_cuda_names_the_install_hint() -> None:
    code = (
        "import sys\n"
        "sys.modules['cupy'] = None; sys.modules['cupy_backends'] = None\n"
        "import numpy as np\n"
        "import kernels.attention, kernels.backend, kernels.cuda, kernels.cuda.attention, kernels.cuda.launch\n"
        "from kernels.backend import get_backend\n"
        "from kernels.errors import BackendUnavailableError\n"
        "from kernels.rows import F32Rows\n"
        "rows = F32Rows(np.ones((3, 8), np.float32), np.ones((3, 4), np.float32))\n"
        "q = np.ones((1, 2, 8), np.float32); r = np.ones((1, 2, 4), np.float32)\n"
        "assert get_backend('cpu').absorbed_attention(q, r, [rows], 0.5).shape == (1, 2, 8)\n"
        "try:\n"
        "    get_backend('cuda')\n"
        "except BackendUnavailableError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "REFUSED" in done.stdout and 'pip install -e ".[cuda]"' in done.stdout


def test_f32_rows_validate_on_the_cpu_backend() -> None:
    with pytest.raises(FormatError, match="no rows"):
        get_backend("cpu").absorbed_attention(np.ones((1, 2, 8), np.float32), np.ones((1, 2, 4), np.float32),
                                              [F32Rows(np.ones((0, 8), np.float32), np.ones((0, 4), np.float32))],
                                              0.5, causal=False)
