"""Shared pytest set-up: GPU marker skipping, a quiet log, and the fixtures every room uses."""
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


@pytest.fixture(scope="module")
def tiny():  # noqa: ANN201 - an MLADecoder
    """The embedded tiny model (random weights, byte vocabulary), loaded once per test module."""
    from kernels.model import load_model

    return load_model("tiny")


@pytest.fixture(scope="session")
def tiny_glm_dir(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a pathlib.Path
    """A tiny random glm_moe_dsa checkpoint directory (DSA indexer, shared layers), written with numpy."""
    from kernels.model.tiny_glm import write_tiny_glm

    return write_tiny_glm(tmp_path_factory.mktemp("tiny-glm"))
