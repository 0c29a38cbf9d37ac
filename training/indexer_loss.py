"""Training signals transformers' GLM model does not provide: the DSA indexer's loss and expert balance.

transformers runs the indexer under ``no_grad`` (its top-k is not differentiable), so the indexer
of a freshly initialised model never learns. As in DeepSeek-V3.2's dense warm-up, each full
layer's indexer is trained to predict where attention goes: the target is the causal attention
distribution (heads and the layers that share this layer's selection averaged), the loss
KL(target || softmax(indexer scores)). The indexer's inputs are detached, so this loss trains the
indexer alone. Scores are computed here with the indexer's own parameters, following the scoring
rule of the engine facts (relu of scaled dot products, weighted over heads).

Experts are balanced without an auxiliary loss (DeepSeek-V3's rule): after each step, every
router's ``e_score_correction_bias`` moves by ``gamma`` towards under-loaded experts.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave


class IndexerTap:
    """Captures each full layer's indexer inputs in a forward pass (detached)."""

    def __init__(self, model: Any) -> None:
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.modules: dict[int, Any] = {}
        for i, layer in enumerate(model.model.layers):
            ix = layer.self_attn.indexer
            if ix is not None:
                self.modules[i] = ix
                ix.register_forward_pre_hook(self._hook(i))

    def _hook(self, i: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            x, q_resid, (cos, sin) = args[0], args[1], args[2]
            self.inputs[i] = (x.detach(), q_resid.detach(), cos.detach(), sin.detach())
        return hook

    def groups(self, n_layers: int) -> dict[int, list[int]]:
        """Full layer -> the layers attending with its selection (itself and the shared ones after it)."""
        out: dict[int, list[int]] = {}
        current = -1
        for i in range(n_layers):
            if i in self.modules:
                current = i
            out.setdefault(current, []).append(i)
        return out


def index_logits(ix: Any, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Indexer scores with gradients: [B, S, T] (future positions -inf)."""
    b, s, _ = x.shape
    nh, hd, r = ix.n_heads, ix.head_dim, ix.qk_rope_head_dim
    q = ix.wq_b(q_resid).view(b, s, nh, hd)  # q: [B, S, nh, hd]
    k = ix.k_norm(ix.wk(x)).unsqueeze(2)  # k: [B, S, 1, hd]
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., r:]], dim=-1)
    k = torch.cat([k_rot, k[..., r:]], dim=-1).squeeze(2)  # k: [B, T, hd]
    dots = F.relu(torch.einsum("bshd,btd->bsht", q, k) * hd ** -0.5)  # dots: [B, S, nh, T]
    w = ix.weights_proj(x.float()) * nh ** -0.5  # w: [B, S, nh]
    logits = torch.einsum("bsh,bsht->bst", w, dots)  # logits: [B, S, T]
    future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    return logits.masked_fill(future, float("-inf"))


def indexer_kl(tap: IndexerTap, attentions: tuple[torch.Tensor, ...], query_mask: torch.Tensor) -> torch.Tensor:
    """Mean KL(attention || indexer) over full layers and the query positions in ``query_mask`` [B, S]."""
    total = torch.zeros(())
    groups = tap.groups(len(attentions))
    for full, ix in tap.modules.items():
        x, q_resid, cos, sin = tap.inputs[full]
        target = torch.stack([attentions[i].detach().float().mean(1) for i in groups[full]]).mean(0)  # [B, S, T]
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-9)
        logq = F.log_softmax(index_logits(ix, x, q_resid, cos, sin), dim=-1)  # logq: [B, S, T]
        kl = (target * (torch.log(target.clamp_min(1e-9)) - logq.clamp_min(-1e4))).sum(-1)  # kl: [B, S]
        total = total + (kl * query_mask).sum() / query_mask.sum().clamp_min(1)
    return total / max(len(tap.modules), 1)


class ExpertBalancer:
    """Counts each router's expert picks; ``step()`` nudges the correction biases towards balance."""

    def __init__(self, model: Any, gamma: float) -> None:
        self.gamma = gamma
        self.routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        self.loads: dict[int, torch.Tensor] = {}
        for j, gate in enumerate(self.routers):
            gate.register_forward_hook(self._hook(j))

    def _hook(self, j: int) -> Any:
        def hook(module: Any, args: Any, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
            picks = out[2].reshape(-1)
            counts = torch.bincount(picks, minlength=module.num_experts).float()
            self.loads[j] = self.loads.get(j, torch.zeros_like(counts)) + counts
        return hook

    def step(self) -> float:
        """Apply the bias update; returns the worst max/mean load ratio seen since the last step."""
        worst = 1.0
        with torch.no_grad():
            for j, gate in enumerate(self.routers):
                load = self.loads.get(j)
                if load is None or load.sum() == 0:
                    continue
                gate.e_score_correction_bias += self.gamma * torch.sign(load.mean() - load)
                worst = max(worst, float(load.max() / load.mean()))
        self.loads.clear()
        return worst
