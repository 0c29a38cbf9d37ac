"""Small text checkpoints for tests: a BPE tokenizer trained here with ``tokenizers``, a chat
template (GLM-style or ChatML-style) and a tiny random glm_moe_dsa model whose vocabulary matches.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kernels.model.config import parse_config
from kernels.model.tiny_glm import tiny_glm_config_dict, tiny_glm_weights, write_safetensors

GLM_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

GLM_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>\n{{ m.content }}"
    "{% elif m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content | trim }}"
    "{% else %}{{ raise_exception('unknown role: ' ~ m.role) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CHATML_TEMPLATE = (
    "{% if messages[0].role != 'system' and messages | length > 1 and messages[1].role == 'system' %}"
    "{{ raise_exception('the system message must come first') }}{% endif %}"
    "{{ bos_token }}"
    "{% for message in messages %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello there, how are you today? I am fine, thank you.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe",
    "\u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e\u306e\u6587\u7ae0 \ud55c\uad6d\uc5b4",
    "emoji: \U0001f600 \U0001f680 \u2764\ufe0f \U0001f44d\U0001f3fd",
    "Sessions keep their latent cache on disk and resume token-exact.",
    "What is the capital of France? Paris is the capital of France.",
]


def train_tokenizer(specials: list[str], vocab_size: int = 420) -> Any:
    """A byte-level BPE trained on CORPUS with ``specials`` as special added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def write_text_model(directory: str | Path, style: str = "glm", *, template_form: str = "string",
                     seed: int = 1234) -> Path:
    """A checkpoint dir: config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    (+ generation_config.json). ``template_form``: "string" | "named" | "jinja" (chat_template.jinja)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    glm = style == "glm"
    tok = train_tokenizer(GLM_SPECIALS if glm else CHATML_SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    template = GLM_TEMPLATE if glm else CHATML_TEMPLATE
    tcfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
                            "clean_up_tokenization_spaces": False}
    if glm:
        tcfg.update(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    else:
        tcfg.update(bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if template_form == "string":
        tcfg["chat_template"] = template
    elif template_form == "named":
        tcfg["chat_template"] = [{"name": "default", "template": template},
                                 {"name": "other", "template": "{{ raise_exception('not this one') }}"}]
    else:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))
    cfg = tiny_glm_config_dict()
    cfg["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
    ids = {s: tok.token_to_id(s) for s in (GLM_SPECIALS if glm else CHATML_SPECIALS)}
    if glm:  # GLM lists several eos ids: end of text, the next user turn, an observation
        cfg.update(bos_token_id=None, pad_token_id=ids["<|endoftext|>"],
                   eos_token_id=[ids["<|endoftext|>"], ids["<|user|>"]])
        gen = {"eos_token_id": [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]}
    else:
        cfg.update(bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
                   eos_token_id=ids["<|im_end|>"])
        gen = {"eos_token_id": ids["<|im_end|>"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps(gen))
    write_safetensors(out / "model.safetensors", tiny_glm_weights(parse_config(cfg, source=str(out)), seed))
    return out
