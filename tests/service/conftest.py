"""Fixtures of the service tests: a small text model (tokenizer + chat template + random GLM
weights) written once, and its decoder + tokenizer for the in-process reference runs."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers", reason="the text extra (tokenizers) builds the test tokenizer")
pytest.importorskip("uvicorn", reason="the service extra (starlette, uvicorn) runs the server")
pytest.importorskip("openai", reason="the service tests talk to the server through the openai client")


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.kernels.model.text.textkit import write_text_model

    return write_text_model(tmp_path_factory.mktemp("service-model"), "glm")


@pytest.fixture(scope="session")
def text_model(text_model_dir: Path) -> tuple[Any, Any]:
    """(decoder, tokenizer) of the test model, for the uninterrupted in-process runs."""
    from kernels.model import load_model
    from kernels.model.text import load_text

    return load_model(str(text_model_dir)), load_text(text_model_dir)
