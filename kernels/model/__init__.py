"""Reference MLA decoders (DeepSeek-V3 family; GLM-5.x with DSA) over a latent cache in f32, fp8 or v3 4-bit codes.

Public surface: :func:`load_model` (a Hugging Face checkpoint directory or ``"tiny"``; the config's
``model_type`` picks :class:`MLADecoder` or :class:`GlmDecoder`), :class:`DecoderCache`,
:class:`Sampler` / :func:`sample`, :func:`generate`, and the seam sessions are typed against
(kernels.model.protocols): :class:`Decoder`, :class:`LatentCache`, :class:`DecoderConfig`, which
``MLADecoder``, ``GlmDecoder``, ``DecoderCache`` and ``ModelConfig`` satisfy.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from kernels.errors import NotFoundError
from kernels.lazy import lazy_members
from kernels.model.config import ModelConfig, load_config, parse_config
from kernels.model.glm_config import GLM_MODEL_TYPE
from kernels.model.protocols import Decoder, DecoderConfig, LatentCache
from kernels.model.sampling import Sampler, sample
from kernels.model.tiny import TINY_NAME, TINY_SEED, encode_text, tiny_checkpoint
from kernels.model.weights import open_checkpoint

if TYPE_CHECKING:  # imported on first use at run time (the module __getattr__ below)
    from kernels.model.cache import DecoderCache
    from kernels.model.decoder import MLADecoder
    from kernels.model.generate import GenerateResult, generate
    from kernels.model.glm_decoder import GlmDecoder

# the decoders and their cache run compiled kernels (numba): imported on first use, so a process
# that reads sessions without computing (the API process of serve --http, a CLI command over
# files) loads none of them
_COMPILED = {"DecoderCache": "kernels.model.cache", "MLADecoder": "kernels.model.decoder",
             "GenerateResult": "kernels.model.generate", "generate": "kernels.model.generate",
             "GlmDecoder": "kernels.model.glm_decoder"}

__getattr__ = lazy_members(__name__, _COMPILED)

GLM_MINI_NAME = "glm-mini"  # the small trained GLM-5-architecture model shipped in the repository
SHIPPED_MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


def resolve_model(name: str | os.PathLike[str]) -> str:
    """A model name as a loadable source: ``"tiny"`` stays, ``"glm-mini"`` becomes the shipped
    checkpoint directory (models/glm-mini/), anything else is a checkpoint directory path."""
    src = os.fspath(name)
    if src == GLM_MINI_NAME and not os.path.isdir(src):
        shipped = SHIPPED_MODELS_DIR / GLM_MINI_NAME
        if not (shipped / "config.json").is_file():
            raise NotFoundError(f"the shipped model {GLM_MINI_NAME!r} is not in this checkout ({shipped}); "
                                "pass --model DIR or --model tiny")
        return str(shipped)
    return src


def load_model(path_or_tiny: str | os.PathLike[str]) -> MLADecoder:
    """Load ``"tiny"`` (the embedded model), ``"glm-mini"`` (the shipped trained model) or a
    checkpoint directory (config.json + *.safetensors)."""
    from kernels.model.decoder import MLADecoder
    from kernels.model.glm_decoder import GlmDecoder

    if os.fspath(path_or_tiny) == TINY_NAME:
        cfg, weights = tiny_checkpoint(TINY_SEED)
        return MLADecoder(cfg, weights, source=TINY_NAME)
    model_dir = resolve_model(path_or_tiny)
    cfg = load_config(model_dir)
    decoder = GlmDecoder if cfg.model_type == GLM_MODEL_TYPE else MLADecoder
    return decoder(cfg, open_checkpoint(model_dir), source=os.path.abspath(model_dir))


if TYPE_CHECKING:  # `mypy kernels` holds the concrete decoders, cache and config to the protocols

    def _conforms(model: MLADecoder, cache: DecoderCache) -> tuple[Decoder[DecoderCache], LatentCache, DecoderConfig]:
        return model, cache, model.config

    def _glm_conforms(model: GlmDecoder) -> Decoder[DecoderCache]:
        return model


__all__ = [
    "GLM_MINI_NAME",
    "Decoder",
    "DecoderCache",
    "DecoderConfig",
    "GenerateResult",
    "GlmDecoder",
    "LatentCache",
    "MLADecoder",
    "ModelConfig",
    "Sampler",
    "encode_text",
    "generate",
    "load_config",
    "load_model",
    "parse_config",
    "resolve_model",
    "sample",
]
