"""Train models/glm-mini: a small GLM-5-architecture (``glm_moe_dsa``) model, on CPU, in under an hour.

Data: CPython's ``pydoc_data.topics`` (the Python documentation topics; PSF License Version 2),
from the running interpreter (training.corpus). Whole topics are held out for evaluation.
Tokenizer: byte-level BPE (``tokenizers``) with GLM-style special tokens and chat template
(training.tokenizer). Model: transformers ``GlmMoeDsaForCausalLM`` with MLA (kv_lora 64 and
qk_rope 16, powers of two so the 4-bit v3 tier applies), a DSA indexer on "full" layers reused by
"shared" ones, MoE layers with a dense first layer, and ``index_topk`` 32.

Training mixes raw text windows with windows of packed chats (multi-turn, 1-12 turns on one topic: a
section title asked about, its paragraph as the answer; training.train_glm_mini.Batches), no padding.
``--short-seq``/``--short-frac`` train the run's first share on shorter windows (same tokens per step);
``--mix-short-batch N`` instead mixes both in every step: the step's loss is the token-weighted mean over
``--batch`` windows of ``--seq`` and N windows of ``--short-seq`` (default 128), drawn by the same sampler,
so the model keeps its short-context skill while it learns long positions (training.train_glm_mini.mixed_parts);
validation is then the mean of the held-out NLL read in windows of both lengths.
``--init DIR`` goes on training a checkpoint (its tokenizer kept). The first ``--dense-frac`` of the run
attends densely (top-k = the whole window) while the indexer learns to predict attention
(training.indexer_loss); the rest runs the real sparse top-k so the model adapts to it. The run ends at
``--steps`` or the ``--minutes`` budget; the learning-rate schedule follows whichever is nearer.
Validation perplexity (half the held-out topics) is measured every ``--eval-every`` sparse steps and the
best checkpoint is kept; the other half gives the reported test perplexity. Output: a Hugging Face
checkpoint directory (bf16 safetensors + tokenizer files) and ``train_log.json`` (with the command, and
the held-out perplexity by position span: training.train_glm_mini.POSITION_SPANS).

    python -m training.train_glm_mini --out models/glm-mini --minutes 40
    python -m training.train_glm_mini --init models/glm-mini --out /tmp/long --seq 2048 --batch 1 --lr 1e-3 \
        --dense-frac 0.3 --minutes 32     # the long-window run of training/runs/glm-mini-long-2026-12-06.json
    python -m training.train_glm_mini --init models/glm-mini --out /tmp/mix --seq 2048 --batch 1 \
        --mix-short-batch 16 --short-seq 128 --lr 3e-4 --dense-frac 0.3 --minutes 60   # mixed in each step
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from training.corpus import ask, chat_pairs, load_corpus
from training.indexer_loss import ExpertBalancer, IndexerTap, indexer_kl
from training.tokenizer import EOS_TOKENS, PAD_TOKEN, render_chat, special_ids, train_tokenizer, write_tokenizer_files

POSITION_SPANS = ((0, 128), (128, 512), (512, 1024), (1024, 2048))
DATA_NAME = "CPython pydoc_data.topics (Python documentation topics), PSF License Version 2"
N_LAYERS = 6
MODEL_SHAPE: dict[str, Any] = dict(
    hidden_size=160, intermediate_size=448, moe_intermediate_size=96, num_hidden_layers=N_LAYERS,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=16,
    qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=1, mlp_layer_types=["dense"] + ["sparse"] * (N_LAYERS - 1),
    index_topk=32, index_n_heads=4, index_head_dim=32,
    indexer_types=["full", "shared", "shared", "full", "shared", "shared"],
    max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False, attention_bias=False, rms_norm_eps=1e-5,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="models/glm-mini")
    p.add_argument("--minutes", type=float, default=40.0, help="wall-clock training budget")
    p.add_argument("--steps", type=int, default=100000, help="step limit")
    p.add_argument("--vocab", type=int, default=3072)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--short-seq", type=int, default=0,
                   help="window of the run's first --short-frac (0: --seq throughout); same tokens per step")
    p.add_argument("--short-frac", type=float, default=0.0, help="share of the run trained on --short-seq windows")
    p.add_argument("--mix-short-batch", type=int, default=0,
                   help="N > 0: every step also trains N windows of --short-seq (default 128) beside the --seq ones;"
                        " the loss is the token-weighted mean of both (excludes --short-frac)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--chat-frac", type=float, default=0.5, help="share of chat samples in a batch")
    p.add_argument("--dense-frac", type=float, default=0.6, help="share of the run trained dense (indexer warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None,
                   help="go on training this checkpoint (its weights and tokenizer) instead of a fresh model")
    p.add_argument("--attention-dropout", type=float, default=0.0,
                   help="dropout on the attention probabilities while training (the saved config keeps 0.0)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=100, help="steps between validation evaluations")
    args = p.parse_args(argv)
    if not 0.0 <= args.attention_dropout < 1.0:
        p.error("--attention-dropout must be in [0, 1)")
    if args.mix_short_batch < 0:
        p.error("--mix-short-batch must be >= 0")
    if args.mix_short_batch:
        if args.short_frac:
            p.error("--mix-short-batch mixes in every step; it excludes the --short-frac curriculum")
        args.short_seq = args.short_seq or 128
        if not 2 <= args.short_seq <= args.seq:
            p.error("--short-seq must be between 2 and --seq")
    return args


class Batches:
    """Random training windows of ``seq`` tokens: the topics' token stream, or packed multi-turn chats.

    A chat stays on one topic: up to ``max_turns`` questions about that topic's sections (in page
    order from a random start, wrapping round), each answered by its paragraph. Chats are packed back
    to back (each ends in ``<|endoftext|>``) until the window is full, so no position is padding and
    the model sees chats of 1-12 turns reach every position up to ``seq``.
    """

    def __init__(self, tok: Any, corpus: Any, seq: int, chat_frac: float, seed: int, max_turns: int = 12) -> None:
        self.ids = special_ids(tok)
        self.seq, self.chat_frac, self.max_turns = seq, chat_frac, max_turns
        self.rng = random.Random(seed)
        eot = [self.ids["<|endoftext|>"]]
        stream: list[int] = []
        for text in corpus.train_topics.values():
            stream += tok.encode(text).ids + eot
        self.stream = torch.tensor(stream, dtype=torch.long)  # stream: [N] i64
        by_topic = [chat_pairs({name: text}) for name, text in corpus.train_topics.items()]
        self.topics = [pairs for pairs in by_topic if pairs]
        self.pairs = [pair for pairs in self.topics for pair in pairs]
        self.tok = tok

    def chat_sample(self) -> list[int]:
        """One chat on one topic, 1..max_turns turns, rendered with the template and ended by eos."""
        messages: list[dict[str, str]] = []
        if self.rng.random() < 0.2:
            messages.append({"role": "system", "content": "You answer questions about Python."})
        pairs = self.rng.choice(self.topics)
        start = self.rng.randrange(len(pairs))
        for turn in range(self.rng.randint(1, self.max_turns)):
            subject, answer = pairs[(start + turn) % len(pairs)]
            messages += [{"role": "user", "content": ask(subject, self.rng)}, {"role": "assistant", "content": answer}]
        ids: list[int] = self.tok.encode(render_chat(messages) + "<|endoftext|>").ids
        return ids

    def chat_window(self, seq: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < seq:
            ids += self.chat_sample()
        return ids[:seq]

    def next(self, batch: int, seq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, seq] i64, labels [B, seq] i64): every position is a real token."""
        seq = seq or self.seq
        inputs = torch.empty((batch, seq), dtype=torch.long)
        for b in range(batch):
            if self.rng.random() < self.chat_frac:
                inputs[b] = torch.tensor(self.chat_window(seq), dtype=torch.long)
            else:
                start = self.rng.randrange(0, self.stream.numel() - seq)
                inputs[b] = self.stream[start:start + seq]
        return inputs, inputs.clone()


def build_model(vocab: int, ids: dict[str, int], seed: int) -> Any:
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    cfg = GlmMoeDsaConfig(vocab_size=vocab, bos_token_id=ids["[gMASK]"], pad_token_id=ids[PAD_TOKEN],
                          eos_token_id=[ids[t] for t in EOS_TOKENS], **MODEL_SHAPE)
    cfg._attn_implementation = "eager"  # attention probabilities are the indexer's training target
    return GlmMoeDsaForCausalLM(cfg)


def load_checkpoint(directory: Path) -> tuple[Any, Any]:
    """(tokenizer, f32 model with eager attention) of a checkpoint this script wrote: ``--init`` goes on
    training it (its tokenizer is kept, so its ids stay valid)."""
    from tokenizers import Tokenizer
    from transformers import GlmMoeDsaForCausalLM

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    model = GlmMoeDsaForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    model.config._attn_implementation = "eager"  # attention probabilities are the indexer's training target
    return tok, model


def set_topk(tap: IndexerTap, k: int) -> None:
    for ix in tap.modules.values():
        ix.index_topk = k


@torch.no_grad()
def heldout_nll(model: Any, tok: Any, text: str, seq: int, max_windows: int = 64) -> tuple[float, int]:
    """Mean next-token NLL over consecutive ``seq``-token windows of ``text`` (sparse top-k as shipped); a
    text shorter than one window is read as one window of all its tokens (the validation topics: 1,528)."""
    seq = max(2, min(seq, len(tok.encode(text).ids) - 1))
    nll = position_nll(model, tok, text, seq, max_windows)  # nll: [W, seq-1] f32
    return float(nll.mean()) if nll.numel() else 0.0, nll.numel()


@torch.no_grad()
def position_nll(model: Any, tok: Any, text: str, seq: int, max_windows: int = 64) -> torch.Tensor:
    """Next-token NLL [W, seq-1] f32 of consecutive ``seq``-token windows of ``text``: column j predicts token j+1."""
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    rows = []
    model.eval()
    for w in range(min(max_windows, (ids.numel() - 1) // seq)):
        window = ids[w * seq:(w + 1) * seq].unsqueeze(0)  # window: [1, seq] i64
        logits = model(input_ids=window).logits[0, :-1].float()  # logits: [seq-1, V] f32
        rows.append(torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="none"))
    model.train()
    return torch.stack(rows) if rows else torch.zeros((0, seq - 1))


def ppl_by_position(nll: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> dict[str, float]:
    """Perplexity of the predictions at positions [lo, hi) of each window (``nll`` [W, seq-1])."""
    out: dict[str, float] = {}
    for lo, hi in spans:
        part = nll[:, lo:hi]
        if part.numel():
            out[f"ppl_pos_{lo}_{hi}"] = round(math.exp(float(part.mean())), 3)
    return out


def mixed_parts(args: argparse.Namespace, progress: float) -> list[tuple[int, int]]:
    """The (batch, seq) parts of one step: the curriculum's one part, or the long and the short part of
    ``--mix-short-batch``."""
    if args.mix_short_batch:
        return [(args.batch, args.seq), (args.mix_short_batch, args.short_seq)]
    if args.short_seq and progress < args.short_frac:
        return [(args.batch * args.seq // args.short_seq, args.short_seq)]
    return [(args.batch, args.seq)]


def validation_nll(model: Any, tok: Any, text: str, args: argparse.Namespace) -> dict[str, float]:
    """Held-out NLL that picks the kept checkpoint (``valid_nll``): read in ``--seq`` windows, and in mixed mode
    the mean of that (``valid_long``) and the NLL read in ``--short-seq`` windows (``valid_short``), so a
    long-context gain must not cost the short skill."""
    nll, _ = heldout_nll(model, tok, text, args.seq, max_windows=24)
    if not args.mix_short_batch:
        return {"valid_nll": nll}
    short, _ = heldout_nll(model, tok, text, args.short_seq, max_windows=24)
    return {"valid_nll": (nll + short) / 2, "valid_long": round(nll, 4), "valid_short": round(short, 4)}


def lr_at(progress: float, base: float, warmup: float = 0.03) -> float:
    if progress < warmup:
        return base * progress / warmup
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup)))))


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus()
    if args.init:
        tok, model = load_checkpoint(Path(args.init))
        batches = Batches(tok, corpus, args.seq, args.chat_frac, args.seed)
    else:
        tok = train_tokenizer(corpus.train_topics.values(), args.vocab)
        batches = Batches(tok, corpus, args.seq, args.chat_frac, args.seed)
        model = build_model(tok.get_vocab_size(), batches.ids, args.seed)
    set_attention_dropout(model, args.attention_dropout)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    tap, balancer = IndexerTap(model), ExpertBalancer(model, gamma=3e-3)
    topk = model.config.index_topk
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = args.minutes * 60.0
    t0 = time.monotonic()
    log: list[dict[str, float]] = []
    print(f"params {n_params:,}  vocab {tok.get_vocab_size()}  train tokens {batches.stream.numel():,}"
          f"  chat pairs {len(batches.pairs)}", flush=True)
    step, best_nll, best_state, best_step = 0, float("inf"), None, 0
    while step < args.steps:
        elapsed = time.monotonic() - t0
        progress = max(step / args.steps, elapsed / budget)
        if progress >= 1.0:
            break
        dense = progress < args.dense_frac
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, args.lr)
        opt.zero_grad(set_to_none=True)
        parts = mixed_parts(args, progress)
        total = sum(b * (s - 1) for b, s in parts)
        losses, loss, kl = [], torch.zeros(()), torch.zeros(())
        for batch, seq in parts:  # each part's graph is freed by its backward; the tap holds one part's inputs
            set_topk(tap, seq if dense else topk)
            inputs, labels = batches.next(batch, seq)
            result = model(input_ids=inputs, labels=labels, output_attentions=dense)
            part_kl = indexer_kl(tap, result.attentions, (labels != -100).float()) if dense else torch.zeros(())
            weight = batch * (seq - 1) / total  # token-weighted: the mean over every predicted token of the step
            ((result.loss + part_kl) * weight).backward()
            losses.append(float(result.loss.detach()))
            loss, kl = loss + result.loss.detach() * weight, kl + part_kl.detach() * weight
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = balancer.step()
        step += 1
        if step % 10 == 0 or step == 1:
            entry = {"step": step, "s": round(time.monotonic() - t0, 1), "loss": round(float(loss.detach()), 4),
                     "indexer_kl": round(float(kl.detach()), 4), "lr": round(opt.param_groups[0]["lr"], 6),
                     "dense": int(dense), "seq": parts[0][1], "expert_imbalance": round(imbalance, 2)}
            if len(parts) > 1:
                entry["long_loss"], entry["short_loss"] = round(losses[0], 4), round(losses[1], 4)
            if step % args.eval_every == 0 and not dense:
                set_topk(tap, topk)
                entry.update(validation_nll(model, tok, corpus.valid_text, args))
                if entry["valid_nll"] < best_nll:
                    best_nll, best_step = entry["valid_nll"], step
                    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            log.append(entry)
            print(json.dumps(entry), flush=True)
    set_topk(tap, topk)
    train_secs = time.monotonic() - t0
    final_valid = validation_nll(model, tok, corpus.valid_text, args)["valid_nll"]
    if best_state is not None and best_nll < final_valid:
        model.load_state_dict(best_state)
    else:
        best_step = step
    nll, n_tok = heldout_nll(model, tok, corpus.test_text, args.seq)
    train_nll, _ = heldout_nll(model, tok, corpus.train_text[: len(corpus.test_text)], args.seq)
    by_pos = ppl_by_position(position_nll(model, tok, corpus.heldout_text, args.seq), POSITION_SPANS)
    summary = {
        "data": DATA_NAME, "train_topics": len(corpus.train_topics), "heldout_topics": sorted(corpus.heldout_topics),
        "params": n_params, "vocab": tok.get_vocab_size(), "steps": step, "train_seconds": round(train_secs, 1),
        "batch": args.batch, "seq": args.seq, "tokens_seen": tokens_seen(args, step),
        "short_seq": args.short_seq, "short_frac": args.short_frac, "mix_short_batch": args.mix_short_batch,
        "final_train_loss": log[-1]["loss"] if log else None, "kept_step": best_step,
        "test_nll": round(nll, 4), "test_ppl": round(math.exp(nll), 3), "test_tokens": n_tok,
        "train_slice_ppl": round(math.exp(train_nll), 3), "heldout_ppl_by_position": by_pos,
        "command": "python -m training.train_glm_mini " + " ".join(sys.argv[1:]), "args": vars(args),
    }
    save(model, tok, out, summary, log)
    print(json.dumps(summary), flush=True)
    return summary


def tokens_seen(args: argparse.Namespace, steps: int) -> int:
    """Tokens trained on in ``steps`` steps (the curriculum's steps hold the same count as long ones)."""
    return steps * (args.batch * args.seq + args.mix_short_batch * args.short_seq)


def set_attention_dropout(model: Any, p: float) -> None:
    """Dropout ``p`` on every layer's attention probabilities (transformers applies it in train mode only)."""
    model.config.attention_dropout = p
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = p


def save(model: Any, tok: Any, out: Path, summary: dict[str, Any], log: list[dict[str, float]]) -> None:
    set_attention_dropout(model, 0.0)  # a training regulariser, not part of the shipped model
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    write_tokenizer_files(tok, out, model.config.max_position_embeddings)
    (out / "train_log.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
