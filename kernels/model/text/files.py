"""The text files of a checkpoint directory, read with size limits before anything is parsed.

``tokenizer.json`` (the ``tokenizers`` library's format), ``tokenizer_config.json`` (special
tokens, the chat template as a string or as a list of named templates), ``chat_template.jinja``
(which, as in transformers, takes precedence over the config's template) and
``generation_config.json`` (more eos ids). Every problem is one FormatError / LimitError line
naming the file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernels.errors import FormatError, LimitError, NotFoundError
from kernels.jsonfile import read_json_bounded

TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
TEMPLATE_NAME = "chat_template.jinja"
GENERATION_CONFIG_NAME = "generation_config.json"
CONFIG_NAME = "config.json"
MAX_TOKENIZER_BYTES = 64 << 20  # a 256k-entry BPE vocabulary with merges is ~20 MB
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20  # added_tokens_decoder of large vocabularies
MAX_TEMPLATE_BYTES = 1 << 20
MAX_SMALL_JSON_BYTES = 4 << 20
# the named special tokens transformers hands to a chat template (its special_tokens_map)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class TextFiles:
    """What a checkpoint directory says about text: tokenizer JSON, template, special tokens, eos ids."""

    directory: Path
    tokenizer_json: str
    chat_template: str | None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token -> "<s>", ...
    eos_ids: tuple[int, ...] = ()  # ids listed by config.json and generation_config.json
    # tokens the config declares, in the order transformers adds the missing ones to the tokenizer:
    # added_tokens_decoder (by id), the named special tokens, extra/additional special tokens
    declared_tokens: tuple[TokenSpec, ...] = ()


TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


@dataclass(frozen=True)
class TokenSpec:
    """An added token as a config declares it (AddedToken's fields); None flags take its defaults."""

    content: str
    flags: tuple[tuple[str, bool], ...] = ()
    source: str = "added"  # "added" | "named" | "extra"


def _json(path: Path, limit: int, what: str) -> Any:
    try:
        return read_json_bounded(path, limit, what)
    except FileNotFoundError:
        return None


def _token_content(value: Any, where: str, name: str) -> str | None:
    """A special token as the config writes it: a string, an AddedToken dict, or null."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise FormatError(f"{where}: {name} must be a string or an object with a string 'content', found {value!r}")


def _token_spec(value: Any, where: str, name: str, source: str, special: bool | None = None) -> TokenSpec | None:
    """A declared token (string or AddedToken dict); a bare string of a special list is special."""
    if value is None:
        return None
    if isinstance(value, str):
        return TokenSpec(value, (("special", True),) if special else (), source)
    content = _token_content(value, where, name)
    assert content is not None
    flags = []
    for key in TOKEN_FLAGS:
        if key in value:
            if not isinstance(value[key], bool):
                raise FormatError(f"{where}: {name}.{key} must be true or false")
            flags.append((key, bool(value[key])))
    return TokenSpec(content, tuple(flags), source)


def _declared_tokens(config: dict[str, Any], where: str) -> tuple[TokenSpec, ...]:
    out: list[TokenSpec] = []
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise FormatError(f"{where}: added_tokens_decoder must be an object of id -> token")
    try:
        ordered = sorted(decoder.items(), key=lambda kv: int(kv[0]))
    except ValueError:
        raise FormatError(f"{where}: added_tokens_decoder keys must be token ids") from None
    for key, value in ordered:
        if not isinstance(value, dict):
            raise FormatError(f"{where}: added_tokens_decoder[{key}] must be an object")
        spec = _token_spec(value, where, f"added_tokens_decoder[{key}]", "added")
        assert spec is not None
        out.append(spec)
    for name in SPECIAL_TOKEN_NAMES:
        spec = _token_spec(config.get(name), where, name, "named", special=True)
        if spec is not None:
            out.append(spec)
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
    if isinstance(extra, list):
        for i, value in enumerate(extra):
            spec = _token_spec(value, where, f"extra_special_tokens[{i}]", "extra", special=True)
            if spec is not None:
                out.append(spec)
    elif extra is not None and not isinstance(extra, dict):
        raise FormatError(f"{where}: extra_special_tokens must be a list")
    return tuple(out)


def _template_of(config: dict[str, Any], where: str) -> str | None:
    """The config's chat template: a string, or the named-list form (``default`` is used)."""
    raw = config.get("chat_template")
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named: dict[str, str] = {}
        for item in raw:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise FormatError(f"{where}: chat_template list entries must be "
                                  "{'name': str, 'template': str}")
            named[item["name"]] = item["template"]
        if "default" not in named:
            raise FormatError(f"{where}: chat_template has named templates {sorted(named)} but no 'default'")
        return named["default"]
    raise FormatError(f"{where}: chat_template must be a string or a list of named templates")


def _ids_of(value: Any, where: str, name: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise FormatError(f"{where}: {name} must be a token id or a list of them, found {value!r}")
    return [int(v) for v in items]


def _read_text(path: Path, limit: int, what: str) -> str:
    with open(path, "rb") as fh:
        raw = fh.read(limit + 1)
    if len(raw) > limit:
        raise LimitError(f"{path}: {what} larger than {limit} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: {what} is not valid UTF-8 ({exc})") from None


def read_text_files(directory: str | os.PathLike[str]) -> TextFiles:
    """Read a checkpoint directory's tokenizer, template, special tokens and eos ids (bounded)."""
    root = Path(directory)
    tok_path = root / TOKENIZER_NAME
    if not tok_path.is_file():
        others = sorted(p.name for p in root.glob("tokenizer*")) if root.is_dir() else []
        hint = f" (found {', '.join(others)}: only tokenizer.json is supported)" if others else ""
        raise NotFoundError(f"{root}: no {TOKENIZER_NAME}{hint}")
    tokenizer_json = _read_text(tok_path, MAX_TOKENIZER_BYTES, "tokenizer")
    cfg_path = root / TOKENIZER_CONFIG_NAME
    config = _json(cfg_path, MAX_TOKENIZER_CONFIG_BYTES, "tokenizer config") or {}
    if not isinstance(config, dict):
        raise FormatError(f"{cfg_path}: tokenizer config must be a JSON object")
    template = _template_of(config, str(cfg_path))
    if (root / TEMPLATE_NAME).is_file():
        template = _read_text(root / TEMPLATE_NAME, MAX_TEMPLATE_BYTES, "chat template")
    elif template is not None and len(template.encode("utf-8")) > MAX_TEMPLATE_BYTES:
        raise LimitError(f"{cfg_path}: chat_template larger than {MAX_TEMPLATE_BYTES} bytes")
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
        content = _token_content(config.get(name), str(cfg_path), name)
        if content is not None:
            special[name] = content
    eos: list[int] = []
    for name in (CONFIG_NAME, GENERATION_CONFIG_NAME):
        obj = _json(root / name, MAX_SMALL_JSON_BYTES, name)
        if isinstance(obj, dict):
            eos += [i for i in _ids_of(obj.get("eos_token_id"), str(root / name), "eos_token_id") if i not in eos]
    return TextFiles(root, tokenizer_json, template, special, tuple(eos), _declared_tokens(config, str(cfg_path)))


__all__ = ["MAX_TEMPLATE_BYTES", "MAX_TOKENIZER_BYTES", "TextFiles", "TokenSpec", "read_text_files"]
