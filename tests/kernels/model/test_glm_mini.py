"""The shipped checkpoint models/glm-mini: its size, its tokenizer and chat template files, and greedy
tokens of our decoder equal to transformers' on chat prompts longer than ``index_topk`` (so the DSA
selection and the shared layers run in both)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from kernels.model import GlmDecoder, Sampler, generate, load_model
from kernels.model.glm_config import GLM_MODEL_TYPE

MODEL_DIR = Path(os.environ.get("GLM_MINI_DIR", Path(__file__).resolve().parents[3] / "models" / "glm-mini"))
SIZE_LIMIT = 20 * 1000 * 1000
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
NEW_TOKENS = 24
CHATS = (
    [{"role": "user", "content": "Explain the \"for\" statement."}],
    [{"role": "system", "content": "You answer questions about Python."},
     {"role": "user", "content": "What is the \"with\" statement?"},
     {"role": "assistant", "content": "The \"with\" statement wraps the execution of a block."},
     {"role": "user", "content": "Tell me about context managers."}],
)


def config() -> dict:
    return json.loads((MODEL_DIR / "config.json").read_text())


def render(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    jinja2 = pytest.importorskip("jinja2", reason="the text extra is not installed: pip install -e '.[text]'")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    src = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    return str(env.from_string(src).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           raise_exception=raise_exception))


def tokenizer():
    tokenizers = pytest.importorskip("tokenizers", reason="the text extra is not installed: pip install -e '.[text]'")
    return tokenizers.Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def chat_ids(messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer().encode(render(messages)).ids)


@pytest.fixture(scope="module")
def glm() -> GlmDecoder:
    model = load_model(MODEL_DIR)
    assert isinstance(model, GlmDecoder)
    return model


def test_checkpoint_files_and_size() -> None:
    for name in REQUIRED:
        assert (MODEL_DIR / name).is_file(), f"{name} is missing from {MODEL_DIR}"
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total <= SIZE_LIMIT, f"{MODEL_DIR} holds {total} bytes, over the {SIZE_LIMIT} limit"


def test_config_is_glm_dsa_with_v3_widths(glm: GlmDecoder) -> None:
    cfg = glm.config
    assert cfg.model_type == GLM_MODEL_TYPE
    for width in (cfg.kv_lora_rank, cfg.qk_rope_head_dim):
        assert width & (width - 1) == 0 and 2 <= width <= 512, f"row width {width} is not a v3 width"
    types = glm.dsa.indexer_types
    assert "full" in types and "shared" in types and types[0] == "full"
    mlp = config()["mlp_layer_types"]
    assert "dense" in mlp and "sparse" in mlp
    assert glm.dsa.index_topk < min(len(chat_ids(c)) + NEW_TOKENS for c in CHATS)


def test_tokenizer_and_template_parse() -> None:
    tok, cfg = tokenizer(), config()
    specials = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|endoftext|>")
    ids = {t: tok.token_to_id(t) for t in specials}
    assert all(isinstance(i, int) for i in ids.values()), ids
    for t, i in ids.items():
        assert tok.encode(t).ids == [i], f"{t} is not one token"
    eos = cfg["eos_token_id"]
    assert ids["<|endoftext|>"] in eos and ids["<|user|>"] in eos
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert sorted(gen["eos_token_id"]) == sorted(eos)
    text = render(CHATS[1])
    assert text.startswith("[gMASK]<sop><|system|>\n") and text.endswith("<|assistant|>\n")
    assert render(CHATS[1], add_generation_prompt=False).endswith("Tell me about context managers.")
    got = chat_ids(CHATS[1])
    assert got[:3] == [ids["[gMASK]"], ids["<sop>"], ids["<|system|>"]] and got[-1] != ids["<|user|>"]
    assert [i for i in got if i == ids["<|user|>"]] == [ids["<|user|>"]] * 2
    assert tok.decode(got, skip_special_tokens=False) == text
    with pytest.raises(ValueError, match="unknown role"):
        render([{"role": "robot", "content": "hi"}])


def test_transformers_renders_the_same_template() -> None:
    transformers = pytest.importorskip("transformers", reason="the oracle extra is not installed")
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    for chat in CHATS:
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == render(chat)
        ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert list(ids) == chat_ids(chat)


def test_greedy_tokens_equal_transformers(glm: GlmDecoder) -> None:
    torch = pytest.importorskip("torch", reason="the oracle extra is not installed: pip install -e '.[oracle]'")
    transformers = pytest.importorskip("transformers", reason="the oracle extra is not installed")
    torch.set_num_threads(1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    for chat in CHATS:
        prompt = chat_ids(chat)
        ours = generate(glm, glm.new_cache("f32"), prompt, NEW_TOKENS, Sampler()).tokens
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):  # full recompute each step: transformers' own prefill path
                logits = hf(input_ids=torch.tensor([seq])).logits[0, -1]
                seq.append(int(logits.argmax()))
        theirs = seq[len(prompt):]
        assert len(prompt) + NEW_TOKENS > glm.dsa.index_topk
        assert ours == theirs, f"ours {ours} != transformers' {theirs}"
        assert len(set(ours)) > 1, "the answer is one repeated token: the checkpoint is not trained"


def test_answers_are_words(glm: GlmDecoder) -> None:
    tok = tokenizer()
    ids = generate(glm, glm.new_cache("f32"), chat_ids(CHATS[0]), 32, Sampler(), stop_at_eos=True).tokens
    text = tok.decode(ids, skip_special_tokens=True)
    words = [w for w in text.split() if w.isalpha()]
    assert len(words) >= 3, f"the trained model's answer has no words: {text!r}"
    assert np.mean([len(w) for w in words]) < 12
