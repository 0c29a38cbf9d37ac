"""A GLM-5 (``glm_moe_dsa``) or DeepSeek-V3 decoder's weights packed once for the compiled step
(:mod:`kernels.model.compiled_step`): stacked per layer kind, transposed to ``[in, out]`` as the
row-product kernels read them, contiguous f32, plus the dims and per-layer kinds as small arrays.
A DeepSeek-V3 model is packed as a GLM-5 model without the DSA indexer: its indexer weights are
empty, and every layer attends every row (``index_heads`` 0, ``slot_of`` -1 everywhere).

Packing copies the weights (a second copy of the model's f32 projections): it is made only for a
model the compiled step serves (:func:`packable` says why not otherwise), once per decoder. At
GLM-5.2's dims that is GBs: the decoder's own copy stays (the reference step, for a batch mixing kv
dtypes or another backend, reads it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.model.moe import DenseMLP, MoE
from kernels.model.once_product import panel_order
from kernels.model.rowwise import THREADED_BYTES, column_block
from kernels.model.step_math import numpy_exp_matches

# dims[i]: the step's integer dims, by name (compiled code indexes the array with these constants)
DIM_NAMES = ("layers", "heads", "nope", "rope", "kv_lora", "v_head", "q_lora", "index_dim", "index_heads",
             "index_topk", "experts", "experts_per_tok", "n_group", "topk_group", "norm_topk", "interleave",
             "block_q_a", "block_q_b", "block_kv_a", "block_o", "block_dense", "block_down", "block_router",
             "block_shared", "block_shared_down", "block_wk", "block_wq_b", "block_wp", "block_lm", "vocab",
             "once_bytes")
# fdims[i]: the step's float32 constants
FDIM_NAMES = ("rms_eps", "lora_eps", "softmax_scale", "routed_scale", "index_w_scale", "index_hd_scale",
              "layer_norm_eps")


def _t(w: np.ndarray) -> np.ndarray:
    """w [..., out, in] -> contiguous f32 [..., in, out]."""
    return np.ascontiguousarray(np.swapaxes(np.asarray(w, np.float32), -1, -2))


def _stack(ws: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """The arrays stacked on a new first axis, or an empty [0, *shape] f32 when there are none."""
    return np.ascontiguousarray(np.stack(ws), dtype=np.float32) if ws else np.zeros((0, *shape), np.float32)


def packable(decoder: Any) -> str | None:
    """None when the compiled step serves this decoder, else why not (a GLM DSA or DeepSeek-V3
    model with q_lora, no attention biases, MoE layers with a shared expert and groups of two or
    more experts, and numpy's exp reproduced). Weights of any size: those past ``THREADED_BYTES``
    go through :mod:`kernels.model.once_product` (read once per step for all rows)."""
    cfg = decoder.config
    if cfg.q_lora_rank is None or cfg.attention_bias:
        return "no q_lora or attention biases"
    layers = decoder.layers
    for layer in layers:
        if isinstance(layer.mlp, MoE):
            if layer.mlp.shared is None or cfg.n_routed_experts // cfg.n_group < 2:
                return "an MoE without a shared expert, or groups of one expert"
    if not numpy_exp_matches():
        return "this numpy's float32 exp is not the SIMD routine the compiled step reproduces"
    return None


@dataclass(frozen=True)
class PackedWeights:
    """What the compiled step reads: ``dims`` [len(DIM_NAMES)] i64, ``fdims`` [len(FDIM_NAMES)]
    f32, ``slot_of`` [L] i64 (a layer's indexer slot, -1 for a shared layer), ``mlp_of`` [L] i64
    (a dense layer's index d >= 0, or -1 - m for MoE layer m), and the weight tuples ``attn``,
    ``dense``, ``moe``, ``index``, ``head`` (shapes in :func:`pack`)."""

    dims: np.ndarray
    fdims: np.ndarray
    slot_of: np.ndarray
    mlp_of: np.ndarray
    attn: tuple[np.ndarray, ...]
    dense: tuple[np.ndarray, ...]
    moe: tuple[np.ndarray, ...]
    index: tuple[np.ndarray, ...]
    head: tuple[np.ndarray, ...]

    def dim(self, name: str) -> int:
        return int(self.dims[DIM_NAMES.index(name)])


def pack(decoder: Any, once_bytes: int = THREADED_BYTES) -> PackedWeights:
    """The decoder's weights packed (call :func:`packable` first), transposed to [in, out]; those a
    whole number of 16-column panels wide in panel order (:func:`kernels.model.once_product.panel_order`).
    In the step (:func:`kernels.model.once_product.packed_times`), weights of more than ``once_bytes``
    bytes are read once for all rows with threads over column groups; smaller ones on the step's
    thread (every way the same bits: tests pack with 0 to run every product the first way)."""
    cfg, dsa, layers = decoder.config, getattr(decoder, "dsa", None), decoder.layers

    def tp(w: np.ndarray) -> np.ndarray:  # w [out, in] -> [in, out] f32, in panel order where whole panels
        return panel_order(_t(w))

    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    attn = (
        _stack([ly.input_norm for ly in layers], (hidden,)),  # [L, D]
        _stack([ly.post_norm for ly in layers], (hidden,)),  # [L, D]
        _stack([tp(ly.attn.q_a) for ly in layers], ()),  # [L, D, q_lora]
        _stack([ly.attn.q_a_norm for ly in layers], ()),  # [L, q_lora]
        _stack([tp(ly.attn.q_b) for ly in layers], ()),  # [L, q_lora, H*qk]
        _stack([tp(ly.attn.kv_a) for ly in layers], ()),  # [L, D, kv_lora + rope]
        _stack([ly.attn.kv_a_norm for ly in layers], ()),  # [L, kv_lora]
        _stack([ly.attn.w_uk for ly in layers], ()),  # [L, H, nope, kv_lora]
        _stack([_t(ly.attn.w_uv) for ly in layers], ()),  # [L, H, kv_lora, v_head]
        _stack([tp(ly.attn.o_proj) for ly in layers], ()),  # [L, H*v_head, D]
    )
    dense_layers = [ly.mlp for ly in layers if isinstance(ly.mlp, DenseMLP)]
    moe_layers = [ly.mlp for ly in layers if isinstance(ly.mlp, MoE)]
    inter, moe_inter = cfg.intermediate_size, cfg.moe_intermediate_size
    dense = (
        _stack([tp(m.gate) for m in dense_layers], (hidden, inter)),  # [Ld, D, I]
        _stack([tp(m.up) for m in dense_layers], (hidden, inter)),  # [Ld, D, I]
        _stack([tp(m.down) for m in dense_layers], (inter, hidden)),  # [Ld, I, D]
    )
    shared = [m.shared for m in moe_layers if m.shared is not None]  # (packable: every MoE layer has one)
    n_exp, shared_inter = cfg.n_routed_experts, moe_inter * max(cfg.n_shared_experts, 1)
    moe = (
        _stack([tp(m.gate_w) for m in moe_layers], (hidden, n_exp)),  # [Lm, D, E]
        _stack([m.bias for m in moe_layers], (n_exp,)),  # [Lm, E]
        _stack([np.stack([tp(e.gate) for e in m.experts]) for m in moe_layers], (n_exp, hidden, moe_inter)),
        _stack([np.stack([tp(e.up) for e in m.experts]) for m in moe_layers], (n_exp, hidden, moe_inter)),
        _stack([np.stack([tp(e.down) for e in m.experts]) for m in moe_layers], (n_exp, moe_inter, hidden)),
        _stack([tp(m.gate) for m in shared], (hidden, shared_inter)),  # [Lm, D, Is]
        _stack([tp(m.up) for m in shared], (hidden, shared_inter)),  # [Lm, D, Is]
        _stack([tp(m.down) for m in shared], (shared_inter, hidden)),  # [Lm, Is, D]
    )
    idx = [decoder.indexers[i] for i in dsa.full_layers] if dsa is not None else []  # none: DeepSeek-V3
    nh, hd, topk = (dsa.index_n_heads, dsa.index_head_dim, dsa.index_topk) if dsa is not None else (0, 0, 0)
    q_lora = cfg.q_lora_rank
    index = (  # (the same array kinds without an indexer: one compiled step serves both families)
        _stack([tp(ix.wk) for ix in idx], (hidden, hd)),  # [NI, D, hd]
        _stack([ix.k_norm_weight for ix in idx], (hd,)),  # [NI, hd]
        _stack([ix.k_norm_bias for ix in idx], (hd,)),  # [NI, hd]
        _stack([tp(ix.wq_b) for ix in idx], (q_lora, nh * hd)),  # [NI, q_lora, nh*hd]
        _stack([tp(ix.weights_proj) for ix in idx], (hidden, nh)),  # [NI, D, nh]
    )
    head = (np.ascontiguousarray(decoder.final_norm, np.float32), tp(decoder.lm_head))  # [D], [D, V]
    slots = decoder.index_slots if dsa is not None else {}
    slot_of = np.array([slots.get(i, -1) for i in range(len(layers))], np.int64)  # [L]
    d_i = m_i = 0
    mlp_of = np.empty(len(layers), np.int64)  # [L]
    for i, ly in enumerate(layers):
        if isinstance(ly.mlp, DenseMLP):
            mlp_of[i], d_i = d_i, d_i + 1
        else:
            mlp_of[i], m_i = -1 - m_i, m_i + 1

    def block(w: np.ndarray) -> int:  # w: a packed [.., in, out] weight
        return column_block(w.shape[-2], w.shape[-1]) if w.shape[0] else 1

    dims = dict(
        layers=len(layers), heads=heads, nope=cfg.qk_nope_head_dim, rope=cfg.qk_rope_head_dim,
        kv_lora=cfg.kv_lora_rank, v_head=cfg.v_head_dim, q_lora=cfg.q_lora_rank, index_dim=hd, index_heads=nh,
        index_topk=topk, experts=n_exp, experts_per_tok=cfg.num_experts_per_tok, n_group=cfg.n_group,
        topk_group=cfg.topk_group, norm_topk=int(cfg.norm_topk_prob), interleave=int(decoder.rotary.interleave),
        block_q_a=block(attn[2]), block_q_b=block(attn[4]), block_kv_a=block(attn[5]), block_o=block(attn[9]),
        block_dense=block(dense[0]), block_down=block(dense[2]), block_router=block(moe[0]),
        block_shared=block(moe[5]), block_shared_down=block(moe[7]), block_wk=block(index[0]),
        block_wq_b=block(index[3]), block_wp=block(index[4]),
        block_lm=column_block(head[1].shape[0], head[1].shape[1]), vocab=cfg.vocab_size, once_bytes=once_bytes,
    )
    fdims = dict(rms_eps=cfg.rms_norm_eps, lora_eps=1e-6, softmax_scale=decoder.softmax_scale,
                 routed_scale=cfg.routed_scaling_factor, index_w_scale=max(nh, 1) ** -0.5,
                 index_hd_scale=max(hd, 1) ** -0.5,
                 layer_norm_eps=1e-6)
    return PackedWeights(
        dims=np.array([dims[n] for n in DIM_NAMES], np.int64),
        fdims=np.array([np.float32(fdims[n]) for n in FDIM_NAMES], np.float32),
        slot_of=slot_of, mlp_of=mlp_of, attn=attn, dense=dense, moe=moe, index=index, head=head,
    )


__all__ = ["DIM_NAMES", "FDIM_NAMES", "PackedWeights", "pack", "packable"]
