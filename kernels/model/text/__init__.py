"""Text for the decoders: a checkpoint's ``tokenizer.json`` (through ``tokenizers``), its chat
template rendered as transformers renders it, every eos id the configs list, and incremental
detokenisation (the ``text`` extra: ``tokenizers`` and ``jinja2``)."""
from __future__ import annotations

from kernels.model.text.files import TextFiles, read_text_files
from kernels.model.text.stream import StreamDecoder
from kernels.model.text.template import ChatTemplate, normalize_messages
from kernels.model.text.tokenizer import ChatTokenizer, load_text

__all__ = ["ChatTemplate", "ChatTokenizer", "StreamDecoder", "TextFiles", "load_text", "normalize_messages",
           "read_text_files"]
