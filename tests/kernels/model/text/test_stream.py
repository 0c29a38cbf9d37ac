"""Incremental detokenisation: streamed pieces never hold half a character, and joined they are
exactly the final decode (multi-byte characters split over byte tokens, random id sequences)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kernels.errors import FormatError
from kernels.model.text import ChatTokenizer, StreamDecoder, load_text
from tests.kernels.model.text.textkit import write_text_model

TEXTS = ["plain ascii text", "Caf\u00e9 \u00fcber na\u00efve", "\u4e2d\u6587\u5b57\u7b26\u65e5\u672c\u8a9e",
         "\U0001f600\U0001f680 rocket \U0001f44d\U0001f3fd done", "mixed: a\u00e9\u4e2d\U0001f600z " * 3,
         "never seen: \u0e01\u0e02\u0e03 \u05d0\u05d1 \u2603\ufe0f"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return load_text(write_text_model(tmp_path_factory.mktemp("stream"), "chatml"))


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_equals_final_and_characters_whole(tok: ChatTokenizer, text: str) -> None:
    ids = tok.encode(text)
    split = [i for i in ids if tok.decode([i]) == "\ufffd"]  # tokens holding part of a character
    if any(ord(c) > 0x7ff for c in text):
        assert split, "the test needs characters split over several tokens"
    stream = StreamDecoder(tok)
    pieces = [stream.push(t) for t in ids]
    pieces.append(stream.finish())
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) > 1  # it really streamed


def test_random_ids_stream_to_the_final_text(tok: ChatTokenizer) -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        ids = [int(i) for i in rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 40)))]
        stream = StreamDecoder(tok)
        text = stream.extend(ids) + stream.finish()
        assert text == tok.decode(ids)
        assert stream.text == text


def test_special_tokens_skipped_or_kept(tok: ChatTokenizer) -> None:
    ids = tok.encode("<|im_start|>hi \u00e9<|im_end|>")
    for skip in (True, False):
        stream = StreamDecoder(tok, skip_special_tokens=skip)
        assert stream.extend(ids) + stream.finish() == tok.decode(ids, skip_special_tokens=skip)


def test_metaspace_decoder_streams_exactly(tmp_path: Path) -> None:
    """A decoder that strips a leading space (Metaspace) still streams to the final text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"] + list("abcdefghijklmnopqrstuvwxyz")
    pieces += ["\u2581h", "\u2581w", "\u2581hello", "\u2581world"]
    merges = [("\u2581", "h"), ("\u2581", "w"), ("\u2581h", "e"), ("\u2581w", "o")]
    vocab = {p: i for i, p in enumerate(pieces)}
    vocab.update({"\u2581he": len(vocab), "\u2581wo": len(vocab) + 1})
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    t.add_special_tokens(specials)
    d = write_text_model(tmp_path, "chatml")
    t.save(str(d / "tokenizer.json"))
    tok = load_text(d)
    assert tok.token_bytes() is None  # not byte-level: the window path
    for text in ("hello world", "wide \u00e9\u4e2d\U0001f600 hello", "\u00e9 x", "a  b   \u4e2d"):
        ids = tok.encode(text)
        assert any(tok.decode([i]) == "\ufffd" for i in ids) or text == "hello world"
        assert tok.decode(ids) == text
        stream = StreamDecoder(tok)
        pieces = [stream.push(i) for i in ids] + [stream.finish()]
        assert "".join(pieces) == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces)
    # skipped special tokens before a word: its space must not be stripped as a first token's
    ids = tok.encode("wide \u00e9<|im_end|><|im_start|><|im_end|><|im_start|><|im_end|><|im_start|><|im_end|> hello")
    stream = StreamDecoder(tok)
    assert stream.extend(ids) + stream.finish() == tok.decode(ids) == "wide \u00e9 hello"


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_tokenizers_stream_from_their_byte_table(tok: ChatTokenizer, skip: bool) -> None:
    """glm-mini's tokenizer and the test one are byte-level: the stream takes each token's bytes
    (no decode a token), and joined its pieces are the tokenizer's own decode, lossy UTF-8 (random
    ids split and break characters: U+FFFD where the tokenizer gives one) and special tokens included."""
    from kernels.model import resolve_model

    glm = load_text(resolve_model("glm-mini"))
    rng = np.random.default_rng(36)
    for t in (tok, glm):
        table = t.token_bytes(skip_special_tokens=skip)
        assert table is not None and len(table) == t.vocab_size
        broken = 0
        for _ in range(150):
            ids = [int(i) for i in rng.integers(0, t.vocab_size, size=int(rng.integers(1, 60)))]
            ids[int(rng.integers(0, len(ids)))] = min(t.special_ids)
            stream = StreamDecoder(t, skip_special_tokens=skip)
            pieces = [stream.push(i) for i in ids]
            final = t.decode(ids, skip_special_tokens=skip)
            assert all(final.startswith("".join(pieces[:j])) for j in range(len(pieces)))
            assert "".join(pieces) + stream.finish() == final == stream.text
            broken += "\ufffd" in final
        assert broken > 10, "the ids should break characters"
    with pytest.raises(FormatError):
        StreamDecoder(glm).push(glm.vocab_size)
