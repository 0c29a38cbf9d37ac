"""Fixtures of the decoder tests."""
from __future__ import annotations

import pytest

from kernels.model import MLADecoder, load_model


@pytest.fixture(scope="module")
def model() -> MLADecoder:
    """The embedded tiny model, loaded once per test module."""
    return load_model("tiny")
