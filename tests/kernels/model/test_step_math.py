"""numpy's float32 arithmetic reproduced in compiled code (kernels.model.step_math): the pairwise
sum of ``np.mean``, numpy's SIMD exp, RMSNorm and LayerNorm, bit for bit against numpy itself."""
from __future__ import annotations

import numpy as np
import pytest

from kernels.model.decoder import rms_norm
from kernels.model.glm_indexer import layer_norm
from kernels.model.packed_weights import packable
from kernels.model.step_math import STACK, exp_rows, layer_norm_rows, mean_rows, numpy_exp_matches, rms_norm_rows

WIDTHS = [*range(1, 300), 384, 448, 511, 1000, 1024, 2048, 4095, 6144, 7168, 12288, 20001]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("width", WIDTHS)
def test_the_compiled_mean_is_numpys(width: int) -> None:
    rng = np.random.default_rng(width)
    x = (rng.standard_normal((4, width)) * rng.uniform(1e-3, 1e3)).astype(np.float32)  # [4, width] f32
    x[0, 0] = -0.0
    x[1] = np.abs(x[1])
    for rows in (x, np.square(x), x[:1] * 0 - 0.0):
        want = np.mean(rows, axis=-1, keepdims=True, dtype=np.float32)[:, 0]  # [n] f32
        assert np.array_equal(_bits(mean_rows(rows)), _bits(want))


def test_the_compiled_exp_is_numpys_where_the_step_relies_on_it() -> None:
    """Where numpy's float32 exp is its SIMD routine, ours gives its bits for every value tried; where
    it is not (another CPU or build), the compiled step refuses to serve (so nothing relies on it)."""
    if not numpy_exp_matches():
        from kernels.model import GlmDecoder, load_model, resolve_model
        model = load_model(resolve_model("glm-mini"))
        assert isinstance(model, GlmDecoder) and packable(model) is not None
        return
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(1 << 20).astype(np.float32) * 12,
                        rng.uniform(-110, 95, 1 << 18).astype(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 88.7228, -103.9], np.float32)])
    with np.errstate(over="ignore"):
        want = np.exp(x)  # [n] f32
    got = exp_rows(x)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(_bits(got[ok]), _bits(want[ok]))


@pytest.mark.parametrize("width", [16, 32, 64, 96, 128, 160, 448, 2048, 6144])
def test_the_compiled_norms_are_the_references(width: int) -> None:
    rng = np.random.default_rng(width + 1)
    x = rng.standard_normal((5, width)).astype(np.float32)  # [5, width] f32
    weight, bias = rng.standard_normal((2, width)).astype(np.float32)  # [width] f32 each
    sq = np.empty(width + STACK, np.float32)
    out = np.empty_like(x)
    rms_norm_rows(x, weight, np.float32(1e-5), sq, out)
    assert np.array_equal(_bits(out), _bits(rms_norm(x, weight, 1e-5)))
    layer_norm_rows(x, weight, bias, np.float32(1e-6), sq, out)
    assert np.array_equal(_bits(out), _bits(layer_norm(x, weight, bias)))
