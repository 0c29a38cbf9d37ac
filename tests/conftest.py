"""Shared pytest set-up: GPU marker skipping and a quiet log."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("COLI_LOG", "off")


def _cuda_device_usable() -> bool:
    try:
        import cupy  # noqa: F401
        from cupy.cuda import runtime

        return runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, or CUDARuntimeError: no device
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_device_usable():
        return
    skip_gpu = pytest.mark.skip(reason="no usable CUDA device (cupy absent or no GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
