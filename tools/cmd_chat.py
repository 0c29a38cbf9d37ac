"""``coli-kv chat --root R --session ID [--model M]``: a terminal chat over a persistent session.

Each line read is a user message (piped stdin works: one message per line); the reply streams as
it is produced. Ctrl-C during a reply ends it at the next token boundary and commits the answer
so far; Ctrl-C while waiting for input (or end of input, or ``/quit``) suspends the session and
exits. Commands: ``/history``, ``/regenerate``, ``/edit N TEXT`` (replace user message N, answer
again from there), ``/fork NEW`` (continue in a copy), ``/suspend``, ``/quit``. A later ``chat``
on the same session continues the conversation token-exact.

The session's work runs as jobs on the engine core in this process (:mod:`tools._core`): a reply
takes the path a served turn takes (the loop's batched steps, its decode driver and commit runner).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from kernels.errors import ColiError, FormatError
from kernels.model import GLM_MINI_NAME, resolve_model
from kernels.rows import KV_DTYPES
from sessionstore.sessions import DURABLE_STREAM, SessionOptions, held_until_committed
from tools._common import check_backend, fresh_store
from tools._core import InProcessCore
from tools._text import set_sampler, tokenizer_for

DEFAULT_MAX_NEW = 256
HELP = "commands: /history  /regenerate  /edit N TEXT  /fork NEW  /suspend  /quit"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("chat", help="chat with a model in a persistent session (streams the reply)",
                              description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("--root", required=True, help="the session store directory (created if absent)")
    p.add_argument("--session", required=True, help="session id (created if absent)")
    p.add_argument("--model", default=None, help=f"checkpoint directory or {GLM_MINI_NAME!r} (default: the"
                   f" session's model, or {GLM_MINI_NAME!r} for a new session)")
    p.add_argument("--kv", choices=KV_DTYPES, default="fp8", help="latent cache dtype of a new session (default fp8)")
    p.add_argument("--max-new", type=int, default=DEFAULT_MAX_NEW,
                   help=f"most tokens per reply (default {DEFAULT_MAX_NEW}); a reply also ends at an eos token")
    p.add_argument("--system", default=None, help="a system message starting a new conversation")
    p.add_argument("--commit-every", type=int, default=16, help="commit the reply every N tokens (default 16)")
    p.add_argument("--durable-stream", action=argparse.BooleanOptionalAction, default=DURABLE_STREAM,
                   help="show a token only once it is committed (every token commits; the state page is "
                   "fdatasync'ed): a crash never loses text already shown "
                   f"(default {'on' if DURABLE_STREAM else 'off'})")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (0 = greedy; default:"
                   " the session's, greedy for a new one)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=None, help="keep the smallest set with this probability")
    p.add_argument("--seed", type=int, default=None, help="sampling seed; draws depend only on (seed, position)")
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu", help="attention backend (default cpu)")
    p.add_argument("--json", action="store_true", help="machine output: one JSON object per line (text pieces as"
                   " they stream, then each reply with its ids)")
    p.set_defaults(func=handle)


class _Interrupt:
    """SIGINT while a reply streams: remembered, acted on at the next token boundary."""

    def __init__(self) -> None:
        self.hit = False
        self._old: Any = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.hit = True

    def __enter__(self) -> _Interrupt:
        self.hit = False
        self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._old)

    def __call__(self) -> bool:
        return self.hit


class ChatLoop:
    """One chat: the store, the current session and its conversation, and the output. Whatever
    touches the session runs as a job on ``core``'s loop; this thread reads input, installs the
    Ctrl-C handler and waits."""

    def __init__(self, args: argparse.Namespace, store: Any, core: InProcessCore) -> None:
        self.args = args
        self.store = store
        self.core = core
        self.options = SessionOptions(commit_every=args.commit_every, backend=args.backend,
                                      durable_stream=args.durable_stream)
        self.session: Any = None
        self.conv: Any = None
        self.tok: Any = None
        self.created: set[str] = set()  # sessions this chat created: removed again if left empty

    # ---- output ----------------------------------------------------------------------------
    def emit(self, obj: dict[str, Any], text: str | None = None) -> None:
        if self.args.json:
            print(json.dumps(obj, ensure_ascii=False), flush=True)
        elif text is not None:
            print(text, flush=True)

    def piece(self, text: str) -> None:
        if self.args.json:
            print(json.dumps({"text": text}, ensure_ascii=False), flush=True)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    # ---- sessions --------------------------------------------------------------------------
    def open(self, session_id: str) -> None:
        from sessionstore.sessions.conversation_chat import Conversation

        created = not self.store.exists(session_id)
        if not created:
            source = self.args.model or self.store.read_manifest(session_id).model.path
            tok = tokenizer_for(source)
            model = resolve_model(self.args.model) if self.args.model else None
            self.core.adopt_store_model(self.store, model or source)
        else:
            name = self.args.model or GLM_MINI_NAME
            tok = tokenizer_for(name)
            model = resolve_model(name)
            self.core.adopt_store_model(self.store, model)
        options = self.core.session_options(self.options)

        def open_conversation() -> None:  # kept here at once: a Ctrl-C meanwhile still finds it to close
            if not created:
                session = self.store.open(session_id, model, options)
            else:
                session = self.store.create(session_id, model, kv_dtype=self.args.kv, sampler=self.sampler(None),
                                            options=options)
                self.created.add(session_id)
            try:
                conv = Conversation.open(session, tok)
                wanted = self.sampler(session.manifest.sampler)
                if wanted != session.manifest.sampler:
                    set_sampler(session, wanted)
            except BaseException:
                session.close()
                raise
            self.session, self.conv, self.tok = session, conv, tok

        self.core.call(open_conversation)
        session, conv = self.session, self.conv
        self.emit({"event": "open", "session": session_id, "created": created, "messages": len(conv.messages),
                   "tokens": len(session.history()), "recovered": conv.recovered},
                  None if created else f"[session {session_id}: {len(conv.messages)} messages"
                  + (f", interrupted turn {conv.recovered['action']}" if conv.recovered else "") + "]")

    def sampler(self, base: Any) -> Any:
        """The session's sampler (``base``; greedy for a new one) with the flags given applied, checked."""
        from kernels.model.sampling import Sampler

        given = {k: getattr(self.args, k) for k in ("temperature", "top_k", "top_p", "seed")
                 if getattr(self.args, k) is not None}
        merged = {**dataclasses.asdict(base if base is not None else Sampler()), **given}
        return Sampler.checked(**merged)

    def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None

            def close_session() -> None:
                sid, empty = session.id, not session.history()
                session.close()
                if empty and sid in self.created:  # nothing was said: leave no trace
                    self.store.delete(sid)

            self.core.call(close_session)

    # ---- turns -----------------------------------------------------------------------------
    def reply(self, turn: Callable[..., Any]) -> None:
        """Run ``turn(max_new, on_text=..., should_stop=...)`` streaming, Ctrl-C ending it at a token."""
        if not self.args.json:
            sys.stdout.write("assistant> ")
            sys.stdout.flush()
        with _Interrupt() as interrupt, held_until_committed(self.session, self.piece) as on_text:
            # a job on the loop; the handler (this thread) sets the flag it reads at each token
            r = self.core.call(lambda: turn(self.args.max_new, on_text=on_text, should_stop=interrupt))
        if not self.args.json:
            print("" if r.stopped != "interrupted" else " [interrupted]", flush=True)
        self.emit({"reply": r.to_json(), "session": self.session.id})

    def first_messages(self, text: str) -> list[dict[str, Any]]:
        msgs = self.conv.messages
        if not msgs and self.args.system:
            msgs = [{"role": "system", "content": self.args.system}]
        return [*msgs, {"role": "user", "content": text}]

    def command(self, line: str) -> bool:
        """Run one input line; False when the chat should end."""
        name, _, rest = line.partition(" ")
        if name == "/quit":
            return False
        if name == "/suspend":
            self.core.call(self.session.suspend)
            self.emit({"event": "suspended", "session": self.session.id}, f"[session {self.session.id} suspended]")
        elif name == "/history":
            for i, m in enumerate(self.conv.messages):
                self.emit({"index": i, **m}, f"{i:>3} {m['role']}: {m['content']}")
        elif name == "/regenerate":
            self.reply(self.conv.regenerate)
        elif name == "/edit":
            index, _, text = rest.strip().partition(" ")
            if not index.isdigit() or not text:
                raise FormatError("usage: /edit N TEXT (N from /history)")
            self.reply(functools.partial(self.conv.edit, int(index), text))
        elif name == "/fork":
            new_id = rest.strip()
            if not new_id:
                raise FormatError("usage: /fork NEW")
            self.core.call(lambda: self.conv.fork(new_id))
            old = self.session.id
            self.close()
            self.open(new_id)
            self.emit({"event": "forked", "from": old, "session": new_id}, f"[forked {old} -> {new_id}]")
        elif name.startswith("/"):
            raise FormatError(f"unknown command {name!r}; {HELP}")
        else:
            self.reply(functools.partial(self.conv.say_all, self.first_messages(line)))
        return True

    def run(self, stream: Any) -> int:
        """Read and run lines until end of input or /quit; Ctrl-C outside a reply ends the chat
        (a reply turns it into a stop at the next token: its state is committed either way)."""
        try:
            return self._loop(stream)
        except KeyboardInterrupt:
            return 0

    def _loop(self, stream: Any) -> int:
        interactive = stream.isatty()
        failed = 0
        if interactive:
            print(HELP, file=sys.stderr)
        while True:
            if interactive:
                sys.stderr.write("you> ")
                sys.stderr.flush()
            line = stream.readline()
            if not line:
                break
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                if not self.command(line):
                    break
            except ColiError as exc:
                print(f"coli-kv chat: error: {exc}", file=sys.stderr, flush=True)
                failed = exc.exit_code
                if not interactive:
                    break
        return failed


def handle(args: argparse.Namespace) -> int:
    if args.max_new < 0 or args.commit_every < 0:
        raise FormatError("--max-new and --commit-every must be >= 0")
    check_backend(args.backend)
    with fresh_store(args.root) as store, InProcessCore() as core:  # a store this chat created goes again
        chat = ChatLoop(args, store, core)  # if it fails to start; the core's loop stops whatever ends the chat
        try:
            chat.open(args.session)
            return chat.run(sys.stdin)
        finally:
            chat.close()


__all__ = ["ChatLoop", "handle", "register"]
