"""Text in, text out for ``coli-kv generate`` (``--prompt TEXT`` / ``--messages FILE.json``), with
or without a session; ``coli-kv chat`` uses the same helpers.

Every input (the messages file, the tokenizer, the template, the context room) is checked
before a store is touched, so a refused command leaves the session as it was.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from kernels.errors import ColiError, FormatError
from kernels.jsonfile import read_json_bounded
from kernels.model import Sampler, load_model, resolve_model
from sessionstore.sessions import OutputProcessor, TurnEnd
from tools._core import InProcessCore

if TYPE_CHECKING:  # the text extra (tokenizers, jinja2) is imported only by commands that use text
    from kernels.model.text import ChatTokenizer

MAX_MESSAGES_FILE_BYTES = 32 << 20


def text_input(args: argparse.Namespace) -> tuple[str, Any] | None:
    """("prompt", text) or ("messages", [...]) from the flags (None for neither), checked."""
    prompt, messages_file = getattr(args, "prompt", None), getattr(args, "messages", None)
    given = [name for name, v in (("--prompt", prompt), ("--messages", messages_file),
                                  ("--prompt-ids", getattr(args, "prompt_ids", None))) if v is not None]
    if len(given) > 1:
        raise FormatError(f"{' and '.join(given)} are exclusive: give one of them")
    if prompt is not None:
        if prompt == "":
            raise FormatError("--prompt is empty")
        return "prompt", prompt
    if messages_file is not None:
        return "messages", read_messages_file(messages_file)
    return None


def read_messages_file(path: str) -> list[dict[str, Any]]:
    """An OpenAI-style message list (or an object with one under "messages") from a JSON file."""
    from sessionstore.sessions import check_messages

    try:
        obj = read_json_bounded(path, MAX_MESSAGES_FILE_BYTES, "messages file")
    except FileNotFoundError:
        raise FormatError(f"{path}: no such messages file") from None
    if isinstance(obj, dict) and "messages" in obj:
        obj = obj["messages"]
    messages = check_messages(obj, path)
    if not messages:
        raise FormatError(f"{path}: the message list is empty")
    return messages


def tokenizer_for(model_source: str) -> ChatTokenizer:
    """The tokenizer + chat template of a model ("glm-mini" or a checkpoint directory)."""
    try:
        from kernels.model.text import load_text
    except ImportError as exc:
        raise ColiError(f"text needs the 'text' extra (tokenizers, jinja2): {exc}") from None
    return load_text(resolve_model(model_source))


def prompt_ids(tok: ChatTokenizer, kind: str, value: Any) -> list[int]:
    """Raw text is encoded with the tokenizer's own special tokens; messages through the template."""
    ids = tok.encode(value, add_special_tokens=True) if kind == "prompt" else tok.chat_ids(value)
    if not ids:
        raise FormatError("the prompt tokenizes to nothing")
    return ids


def generate_text(args: argparse.Namespace, kind: str, value: Any, sampler: Sampler, max_new: int) -> int:
    """``generate --prompt/--messages`` without a session: an in-memory cache."""
    if not args.model:
        raise FormatError("--model is required (a checkpoint directory or 'glm-mini') unless --root/--session"
                          " is given")
    tok = tokenizer_for(args.model)
    model = load_model(args.model)
    tok.check_vocab(model.config.vocab_size)
    ids = prompt_ids(tok, kind, value)  # the tokenizer's ids: the model's (check_vocab); their room is
    kv = args.kv or "f32"  # checked by stateless_turn, the CLI's one check of a stateless turn
    cache = model.new_cache(kv, backend=args.backend)
    output = OutputProcessor(eos=frozenset(tok.eos_ids) if args.stop_at_eos else frozenset())
    t0 = time.perf_counter()
    with InProcessCore() as core:  # the turn runs on the engine loop, as a served stateless turn
        core.adopt_decoder(model)
        reply = core.stateless_turn(cache, ids, max_new, sampler, output)
    tokens, stopped = reply.tokens, reply.end is TurnEnd.EOS
    text = tok.decode(tokens)
    print(text)
    summary = {"tokens": tokens, "text": text, "model": model.source, "kv": kv, "backend": args.backend,
               "prompt_tokens": len(ids), "stopped_at_eos": stopped, "sampler": sampler.to_dict(),
               "seconds": round(time.perf_counter() - t0, 6)}
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        print("ids: " + " ".join(str(t) for t in tokens), file=sys.stderr)
    return 0


def session_text_turn(session: Any, args: argparse.Namespace, kind: str, value: Any,
                      tok: ChatTokenizer, max_new: int, sampler: Any) -> dict[str, Any]:
    """One text turn on an open session: messages through its conversation, raw text as ids (the
    conversation file then no longer describes the tokens and is removed first)."""
    from sessionstore.sessions import remove_record, run_turn
    from sessionstore.sessions.conversation_chat import Conversation, check_room

    tok.check_vocab(session.model.config.vocab_size)
    if kind == "messages":
        conv = Conversation.open(session, tok)
        if sampler != session.manifest.sampler:
            set_sampler(session, sampler)
        reply = conv.respond(value, max_new)
        return {**reply.to_json(), "stopped_at_eos": reply.end is TurnEnd.EOS, "committed": session.committed,
                "pending": list(session.pending), "messages": len(conv.messages)}
    ids = prompt_ids(tok, kind, value)  # the tokenizer's ids: the model's (check_vocab above)
    check_room(ids, max_new, session.model.config.max_position_embeddings)  # the one check of the turn's room
    remove_record(session.directory)  # before the tokens change: never a stale conversation
    output = OutputProcessor(eos=frozenset(tok.eos_ids) if getattr(args, "stop_at_eos", False) else frozenset())
    reply = run_turn(output, max_new, sampler, prompt=ids, session=session, keep_sampler=True)
    tokens = reply.tokens
    return {"tokens": tokens, "text": tok.decode(tokens), "stopped_at_eos": reply.end is TurnEnd.EOS,
            "prompt_tokens": reply.prompt_tokens,
            "reused_prefix": reply.reused_prefix, "committed": reply.committed, "pending": list(session.pending)}


def set_sampler(session: Any, sampler: Any) -> None:
    """Store a changed sampler in the manifest (generate does this for token-level turns)."""
    from sessionstore.sessions import MANIFEST_NAME, write_manifest

    session.manifest.sampler = sampler
    write_manifest(session.directory / MANIFEST_NAME, session.manifest)


__all__ = ["MAX_MESSAGES_FILE_BYTES", "set_sampler", "generate_text", "prompt_ids", "read_messages_file",
           "session_text_turn", "text_input", "tokenizer_for"]
