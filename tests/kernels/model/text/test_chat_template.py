"""Chat templates rendered and tokenised as transformers' ``apply_chat_template`` does, and the
one-line refusals of bad tokenizer / template files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernels.errors import FormatError, LimitError, NotFoundError
from kernels.model.text import ChatTemplate, load_text
from kernels.model.text import files as text_files
from tests.kernels.model.text.textkit import write_text_model

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Caf\u00e9 \u4e2d\u6587?"},
     {"role": "assistant", "content": "  Paris is the capital.  "}, {"role": "user", "content": "And \U0001f600?"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": "three <|user|> four"}, {"role": "assistant", "content": "five", "name": None}],
]
LAYOUTS = [("glm", "string"), ("glm", "jinja"), ("chatml", "named"), ("chatml", "string")]


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"{s}-{f}" for s, f in LAYOUTS])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    style, form = request.param
    return write_text_model(tmp_path_factory.mktemp(f"text-{style}-{form}"), style, template_form=form)


@pytest.mark.oracle
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_equals_transformers(model_dir: Path, conv: int, gen: bool) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the apply_chat_template oracle")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ours = load_text(model_dir)
    messages = CONVERSATIONS[conv]
    want_text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    want_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False)
    assert ours.render(messages, add_generation_prompt=gen) == want_text
    assert ours.chat_ids(messages, add_generation_prompt=gen) == list(want_ids)
    # the special tokens in the template became single ids, not their characters
    assert len(set(ours.chat_ids(messages, add_generation_prompt=gen)) & ours.special_ids) >= 1
    assert ours.decode(want_ids, skip_special_tokens=False) == hf.decode(want_ids, skip_special_tokens=False)


@pytest.mark.oracle
def test_raise_exception_like_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the apply_chat_template oracle")
    glm = write_text_model(tmp_path / "glm", "glm")
    chatml = write_text_model(tmp_path / "chatml", "chatml")
    cases = [(glm, [{"role": "wizard", "content": "x"}], "unknown role: wizard"),
             (chatml, [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
              "the system message must come first")]
    for directory, messages, message in cases:
        hf = transformers.AutoTokenizer.from_pretrained(str(directory))
        with pytest.raises(Exception, match=message):
            hf.apply_chat_template(messages, tokenize=False)
        with pytest.raises(FormatError, match=message) as info:
            load_text(directory).render(messages)
        assert "\n" not in str(info.value)


def test_eos_ids_are_every_listed_id(tmp_path: Path) -> None:
    d = write_text_model(tmp_path, "glm")
    tok = load_text(d)
    cfg = json.loads((d / "config.json").read_text())["eos_token_id"]
    gen = json.loads((d / "generation_config.json").read_text())["eos_token_id"]
    assert set(tok.eos_ids) == set(cfg) | set(gen)
    assert len(tok.eos_ids) == 3 and len(set(cfg)) == 2


def test_named_templates_need_a_default(tmp_path: Path) -> None:
    d = write_text_model(tmp_path, "chatml", template_form="named")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [t for t in cfg["chat_template"] if t["name"] != "default"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="no 'default'"):
        load_text(d)


def test_jinja_file_takes_precedence(tmp_path: Path) -> None:
    d = write_text_model(tmp_path, "glm", template_form="string")
    (d / "chat_template.jinja").write_text("X{{ messages[0].content }}Y")
    assert load_text(d).render([{"role": "user", "content": "m"}]) == "XmY"


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong_model", "not_utf8"])
def test_malformed_tokenizer_is_one_line(tmp_path: Path, damage: str) -> None:
    d = write_text_model(tmp_path, "glm")
    raw = (d / "tokenizer.json").read_bytes()
    bad = {"garbage": b"not json at all", "truncated": raw[: len(raw) // 2],
           "wrong_model": raw.replace(b'"type": "BPE"', b'"type": "NoSuchModel"').replace(
               b'"type":"BPE"', b'"type":"NoSuchModel"'),
           "not_utf8": b"\xff\xfe" + raw}[damage]
    assert bad != raw
    (d / "tokenizer.json").write_bytes(bad)
    with pytest.raises(FormatError) as info:
        load_text(d)
    assert "tokenizer.json" in str(info.value) and "\n" not in str(info.value)


def test_unknown_tokenizer_file_is_named(tmp_path: Path) -> None:
    d = write_text_model(tmp_path, "glm")
    (d / "tokenizer.json").rename(d / "tokenizer.model")
    with pytest.raises(NotFoundError, match="only tokenizer.json is supported"):
        load_text(d)
    with pytest.raises(NotFoundError, match="no tokenizer files"):
        load_text("tiny")


def test_sizes_are_checked_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = write_text_model(tmp_path, "glm")
    monkeypatch.setattr(text_files, "MAX_TOKENIZER_BYTES", 1000)
    with pytest.raises(LimitError, match="larger than 1000 bytes"):
        load_text(d)
    monkeypatch.undo()
    (d / "chat_template.jinja").write_text("x" * (text_files.MAX_TEMPLATE_BYTES + 1))
    with pytest.raises(LimitError, match="chat template larger"):
        load_text(d)


@pytest.mark.parametrize("source", ["{% for m in messages %}", "{{ messages[0].content | nosuchfilter }}"])
def test_bad_template_is_one_line(source: str) -> None:
    with pytest.raises(FormatError) as info:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert "\n" not in str(info.value)


def test_sandbox_refuses_unsafe_access() -> None:
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(FormatError):
        t.render([{"role": "user", "content": "x"}])
    ns = ChatTemplate("{% set ns = namespace(_secret=1) %}{{ ns._secret }}")
    with pytest.raises(FormatError):
        ns.render([{"role": "user", "content": "x"}])


@pytest.mark.oracle
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_shipped_model_equals_transformers(conv: int) -> None:
    """The shipped glm-mini's own template and tokenizer, when this checkout has it."""
    from kernels.model import GLM_MINI_NAME, SHIPPED_MODELS_DIR

    transformers = pytest.importorskip("transformers", reason="transformers is the apply_chat_template oracle")
    shipped = SHIPPED_MODELS_DIR / GLM_MINI_NAME
    if not (shipped / "tokenizer.json").is_file():
        pytest.skip(f"{shipped} is not in this checkout (the trained model ships separately)")
    hf = transformers.AutoTokenizer.from_pretrained(str(shipped))
    ours = load_text(shipped)
    messages = CONVERSATIONS[conv]
    for gen in (True, False):
        want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False)
        assert ours.render(messages, add_generation_prompt=gen) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen)
        assert ours.chat_ids(messages, add_generation_prompt=gen) == list(want)


@pytest.mark.oracle
def test_tokens_declared_only_in_the_config(tmp_path: Path) -> None:
    """Special tokens the config names but tokenizer.json lacks are added as transformers adds them
    (named, additional_special_tokens, added_tokens_decoder with its own flags)."""
    from tests.kernels.model.text.textkit import CHATML_TEMPLATE, train_tokenizer

    transformers = pytest.importorskip("transformers", reason="transformers is the tokenizer oracle")
    tok = train_tokenizer([])
    tok.save(str(tmp_path / "tokenizer.json"))
    n = tok.get_vocab_size()
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE,
           "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
           "pad_token": {"__type": "AddedToken", "content": "<|pad|>", "lstrip": False, "rstrip": False,
                         "normalized": False, "single_word": False, "special": True},
           "additional_special_tokens": ["<|im_start|>"],
           "added_tokens_decoder": {str(n + 7): {"content": "<tool>", "lstrip": True, "rstrip": False,
                                                 "normalized": False, "single_word": False, "special": False}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = load_text(tmp_path)
    assert ours.vocab_size > n
    for messages in CONVERSATIONS:
        want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ours.chat_ids(messages) == list(want)
    text = "a  <tool> b<|im_end|> <|im_start|>c<|pad|>"
    ids = hf.encode(text, add_special_tokens=False)
    assert ours.encode(text) == ids
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.eos_ids == (hf.convert_tokens_to_ids("<|im_end|>"),)
