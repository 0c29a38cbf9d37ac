"""Chat templates: Jinja rendered in a sandbox with the environment Hugging Face templates expect.

The environment (learned from transformers' behaviour, written here): an immutable sandbox,
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}``
block that renders its body unchanged, a ``tojson`` filter that is plain ``json.dumps``
(no HTML escaping, non-ASCII kept), and the globals ``raise_exception(msg)``,
``strftime_now(fmt)``, ``dict`` and a ``namespace`` refusing underscore names. A render sees
``messages`` (None-valued keys dropped), ``add_generation_prompt``, no tools or documents,
and the named special tokens (``bos_token``, ``eos_token``, ...).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kernels.errors import FormatError, LimitError

MAX_RENDERED_CHARS = 64 << 20


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_keep", []), [], [], body).set_lineno(lineno)

    def _keep(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` whose attribute names may not start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


class _DictMaker:
    """The template's ``dict``: builds plain dicts, exposes nothing else."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictMaker(),
                       namespace=_Namespace)
    return env


def _plain(value: Any, where: str) -> Any:
    """A JSON-shaped copy (dicts, lists, strings, numbers, booleans, None) of a message."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise FormatError(f"{where}: {type(value).__name__} is not JSON data")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain dict copies of the messages with None-valued keys dropped; refuses non-dicts."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise FormatError("messages must be a list of objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise FormatError(f"message {i} must be an object with 'role' and 'content', found {message!r:.80}")
        out.append({k: v for k, v in _plain(message, f"message {i}").items() if v is not None})
    return out


class ChatTemplate:
    """One compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, *, where: str = "") -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.where = where or "chat template"
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            line = getattr(exc, "lineno", None)
            at = f" (line {line})" if line else ""
            raise FormatError(f"{self.where}: not a valid Jinja template{at}: {exc}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
               **extra: Any) -> str:
        """The conversation as text. A template that raises (``raise_exception`` or an error of
        its own) is one FormatError line."""
        if len(messages) == 0:
            raise FormatError("the conversation is empty: give at least one message")
        context = {**self.special_tokens, **extra}
        try:
            text = self._template.render(messages=normalize_messages(messages), tools=None, documents=None,
                                         add_generation_prompt=bool(add_generation_prompt), **context)
        except jinja2.exceptions.TemplateError as exc:
            raise FormatError(f"{self.where}: the template refused the conversation: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError,
                RecursionError) as exc:
            raise FormatError(f"{self.where}: the template failed: {type(exc).__name__}: {exc}") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise LimitError(f"{self.where}: the rendered conversation is longer than {MAX_RENDERED_CHARS} chars")
        return text


__all__ = ["ChatTemplate", "MAX_RENDERED_CHARS", "normalize_messages"]
