"""How well a trained checkpoint's DSA indexer predicts attention, on the held-out text.

    python -m training.indexer_recall [--model models/glm-mini] [--windows 8]

For every query whose context exceeds ``index_topk``, the share of the dense attention mass (heads
and the layers sharing the selection averaged) that falls on the indexer's top-k positions, beside
two selections of the same size: the most recent k positions, and k positions at random (its
expected share is k / context).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from training.corpus import load_corpus
from training.indexer_loss import IndexerTap, index_logits


def attention_mass(model: Any, tap: IndexerTap, window: torch.Tensor, topk: int) -> dict[str, list[float]]:
    """Attention mass captured per query past ``topk`` by the indexer, recency and random selections."""
    s = window.numel()
    for ix in tap.modules.values():
        ix.index_topk = s  # dense attention: the reference distribution
    out = model(input_ids=window.unsqueeze(0), output_attentions=True)
    groups = tap.groups(len(out.attentions))
    got: dict[str, list[float]] = {"indexer": [], "recent": [], "random": []}
    for full, ix in tap.modules.items():
        x, q_resid, cos, sin = tap.inputs[full]
        target = torch.stack([out.attentions[i][0].float().mean(0) for i in groups[full]]).mean(0)  # [S, T]
        logits = index_logits(ix, x, q_resid, cos, sin)[0]  # logits: [S, T]
        for t in range(topk, s):
            row = target[t, : t + 1]
            picked = logits[t, : t + 1].topk(topk).indices
            got["indexer"].append(float(row[picked].sum()))
            got["recent"].append(float(row[t + 1 - topk:].sum()))
            got["random"].append(topk / (t + 1))
    return got


def main(argv: list[str] | None = None) -> dict[str, float]:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/glm-mini")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager").eval()
    tok = Tokenizer.from_file(f"{args.model}/tokenizer.json")
    ids = torch.tensor(tok.encode(load_corpus().heldout_text).ids, dtype=torch.long)
    tap, topk = IndexerTap(model), int(model.config.index_topk)
    total: dict[str, list[float]] = {"indexer": [], "recent": [], "random": []}
    stride = max(ids.numel() // args.windows, args.seq)
    with torch.no_grad():
        for w in range(min(args.windows, ids.numel() // stride)):
            got = attention_mass(model, tap, ids[w * stride:w * stride + args.seq], topk)
            for k, v in got.items():
                total[k] += v
    result = {f"attention_mass_{k}": sum(v) / max(len(v), 1) for k, v in total.items()}
    result["queries"] = float(len(total["indexer"]))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
