"""Markers for tests that need an optional extra: they skip, saying which, when it is absent."""
from __future__ import annotations

from importlib.util import find_spec

import pytest

CUDA_EXTRA = "the cuda extra is not installed: pip install -e '.[cuda]' (cupy-cuda12x + nvidia-cuda-nvrtc-cu12)"

needs_cuda_extra = pytest.mark.skipif(find_spec("cupy") is None or find_spec("cupy_backends") is None,
                                      reason=CUDA_EXTRA)
