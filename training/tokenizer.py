"""A byte-level BPE tokenizer with GLM-style special tokens, and the chat template of the shipped model.

The template renders turns the way GLM-4/5 checkpoints do: ``[gMASK]<sop>`` once, then per message
``<|system|>``/``<|user|>``/``<|assistant|>`` + newline + content, no separator after an answer
(the next ``<|user|>`` ends it), and ``<|assistant|>`` + newline as the generation prompt.
Generation stops on ``<|endoftext|>``, ``<|user|>`` or ``<|observation|>`` (all listed as eos).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
)
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
PAD_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{{- '[gMASK]<sop>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] in ('system', 'user', 'assistant') -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] -}}"
    "{%- else -%}{{- raise_exception('unknown role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``; special tokens take the first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The template rendered with jinja2 as transformers does (trim_blocks, lstrip_blocks)."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg: str) -> None:
        raise ValueError(msg)

    template = env.from_string(CHAT_TEMPLATE)
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           raise_exception=raise_exception)


def special_ids(tok: Any) -> dict[str, int]:
    return {t: int(tok.token_to_id(t)) for t in SPECIAL_TOKENS}


def write_tokenizer_files(tok: Any, out: Path, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json."""
    tok.save(str(out / "tokenizer.json"))
    ids = special_ids(tok)
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (PAD_TOKEN, "[MASK]")],
        "eos_token": EOS_TOKENS[0],
        "pad_token": PAD_TOKEN,
        "mask_token": "[MASK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")
    smap = {"eos_token": EOS_TOKENS[0], "pad_token": PAD_TOKEN, "mask_token": "[MASK]"}
    (out / "special_tokens_map.json").write_text(json.dumps(smap, indent=1) + "\n")
