"""The session bench/session.py measures: GLM-5.2's cache shape (78 layers, kv_lora 512, rope 64,
vocab 154,880; v2 records of 45,556 B) over a reference decoder with a 64-wide body and random
weights, its committed records written through the real writer."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from kernels.model.config import parse_config
from kernels.model.decoder import MLADecoder
from kernels.model.tiny import tiny_weights
from kernels.model.weights import DictWeights
from kernels.rows import RecordRows
from sessionstore.kvfile import Dims, KVWriter
from sessionstore.sessions import (
    MANIFEST_NAME,
    ModelRef,
    Session,
    SessionStore,
    read_manifest,
    write_manifest,
)

POOL = 512  # distinct random records, reused to fill the file
SEED = 5


def glm_cache_model() -> tuple[MLADecoder, dict]:
    """A decoder with GLM-5.2's cache shape and a small body (see the module doc)."""
    cfg = {
        "model_type": "deepseek_v3", "vocab_size": 154880, "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 78, "num_attention_heads": 1, "num_key_value_heads": 1, "q_lora_rank": 32,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "n_routed_experts": 0, "max_position_embeddings": 65536, "rope_theta": 10000.0,
        "rope_interleave": True, "hidden_act": "silu", "rms_norm_eps": 1e-6, "eos_token_id": 1,
        "bos_token_id": 0, "tie_word_embeddings": False,
    }
    config = parse_config(cfg, source="bench-glm-cache")
    return MLADecoder(config, DictWeights(tiny_weights(config, SEED), source="bench-glm-cache")), cfg


def pool_rows(n: int, dims: Dims, rng: np.random.Generator) -> RecordRows:
    """n records of random non-NaN fp8 codes and positive scales."""
    L = dims.n_layers

    def codes(w: int) -> np.ndarray:
        return rng.integers(0, 0x7F, (n, L, w), dtype=np.uint8)  # [n, L, w] u8

    return RecordRows(tokens=rng.integers(2, dims.vocab, n).astype(np.int32),
                      lc_codes=codes(dims.kv_lora), lc_scale=rng.uniform(1e-3, 1, (n, L)).astype(np.float32),
                      rc_codes=codes(dims.qk_rope), rc_scale=rng.uniform(1e-3, 1, (n, L)).astype(np.float32))


def build_session(store: SessionStore, model: MLADecoder, ref: ModelRef, n_tokens: int) -> Session:
    """An fp8 session with ``n_tokens`` committed records written through the real writer.

    The first n-1 records are random codes; the last is decoded by the model over them, so the
    digest and the rows of the last position are genuine and resume verification can check them.
    """
    s = Session.create(store, "glm", model, ref, kv_dtype="fp8")
    s.suspend()
    dims = Dims(**s.manifest.dims)
    rng = np.random.default_rng(SEED)
    pool = pool_rows(POOL, dims, rng)
    assert pool.lc_codes is not None and pool.lc_scale is not None  # fp8 pool
    assert pool.rc_codes is not None and pool.rc_scale is not None
    with KVWriter.open(s.kv_path, dims, kv_dtype="fp8", create=False) as writer:
        for start in range(0, n_tokens - 1, POOL):
            k = min(POOL, n_tokens - 1 - start)
            writer.append(RecordRows(tokens=rng.integers(2, dims.vocab, k).astype(np.int32),
                                     lc_codes=pool.lc_codes[:k], lc_scale=pool.lc_scale[:k],
                                     rc_codes=pool.rc_codes[:k], rc_scale=pool.rc_scale[:k]))
        writer.commit()
    manifest = read_manifest(s.directory / MANIFEST_NAME)
    manifest.committed, manifest.pending, manifest.last_logits = n_tokens - 1, [], None
    write_manifest(s.directory / MANIFEST_NAME, manifest)
    s.options = replace(s.options, verify=False)
    s.ensure_resident()
    s.append_tokens([7], commit=True)
    s.suspend()
    return s


__all__ = ["POOL", "SEED", "build_session", "glm_cache_model", "pool_rows"]
