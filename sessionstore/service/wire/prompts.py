"""A turn's prompt, rendered and tokenised once: the chat template over ``messages`` with the
generation prompt, a text prompt through the tokenizer, or token ids as given. The API process
renders every request's prompt here and sends the ids to the engine core."""
from __future__ import annotations

from typing import Any

from kernels.errors import ColiError, FormatError
from kernels.model.text import ChatTokenizer
from sessionstore.service.errors import ApiError


def template_reason(message: str, tok: ChatTokenizer) -> str:
    """A template error's message without the checkpoint's location that begins it."""
    template = tok.template
    for where in ([template.where] if template is not None else []) + [tok.source]:
        if message.startswith(where + ": "):
            return message[len(where) + 2:]
    return message


def load_tokenizer(model_source: str) -> Any:
    """The model's tokenizer and chat template, or None for a model without text files."""
    try:
        from kernels.model.text import load_text
    except ImportError:
        return None
    try:
        return load_text(model_source)
    except (ColiError, OSError):
        return None


class PromptRenderer:
    """Renders prompts with one model's tokenizer and chat template (None: a model without text
    files, which takes token ids only)."""

    def __init__(self, tokenizer: ChatTokenizer | None) -> None:
        self.tok = tokenizer

    def text_tokenizer(self, what: str) -> ChatTokenizer:
        """The tokenizer, or a 400 saying ``what`` needs one."""
        if self.tok is None:
            raise ApiError(400, f"{what} needs text, and this server's model has no tokenizer files; "
                           "send token ids to /v1/completions", code="no_tokenizer")
        return self.tok

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """``messages`` rendered with the generation prompt and tokenised; a template that cannot
        render them (a role it refuses, tool calls it never mentions) is a 400 without paths."""
        tok = self.text_tokenizer("chat")
        template = tok.template
        if template is not None and "tool_calls" not in template.source:
            for i, m in enumerate(messages):
                if "tool_calls" in m:
                    raise ApiError(400, f"messages.{i}.tool_calls: this model's chat template does not render "
                                   "tool calls", param=f"messages.{i}.tool_calls", code="unsupported_messages")
        try:
            return tok.chat_ids(messages, add_generation_prompt=True)
        except FormatError as exc:
            raise ApiError(400, "this model's chat template cannot render these messages: "
                           f"{template_reason(str(exc), tok)}", param="messages", code="unsupported_messages") from None

    def prompt_ids(self, kind: str, messages: list[dict[str, Any]] | None, prompt: str | list[int] | None
                   ) -> list[int]:
        """The ids of a ``chat`` turn's messages or a ``completion`` turn's prompt (not yet checked
        against the vocabulary: the engine core does that)."""
        if kind == "chat":
            return self.chat_ids(messages or [])
        if isinstance(prompt, str):
            return self.text_tokenizer("a text prompt").encode(prompt, add_special_tokens=True)
        return list(prompt or [])


__all__ = ["PromptRenderer", "load_tokenizer", "template_reason"]
