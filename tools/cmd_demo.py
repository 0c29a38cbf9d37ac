"""``coli-kv demo``: a multi-turn chat, suspended after the first turn and resumed in SEPARATE
processes for the next ones, compared token for token with the same conversation run
uninterrupted in memory. Prints the conversation, a short table and ``token-exact: yes`` only when
every token matched (else ``no`` and exit 1).

With the default model, the shipped trained ``glm-mini`` (GLM-5 architecture, DSA indexer), the
chat is text: messages rendered by the model's chat template, replies streamed by
``coli-kv chat`` in the later processes; the sessions run on fp8 and on the 4-bit tier (int4).
``--model tiny`` runs the old byte-level chat of the random tiny model (its replies are noise).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from kernels.errors import ColiError
from kernels.model import encode_text
from kernels.model.sampling import Sampler
from sessionstore.sessions import SessionStore, reference_turns

# the user's turns, in order (--turns takes the first N): questions about the manual's statements, one topic
USER_TURNS = ('Explain the "for" statement.', 'What is the "while" statement?', 'Tell me about the "try" statement.',
              'Describe the "with" statement.', 'What does the manual say about the "if" statement?',
              'Explain the "match" statement.', "What is a scope?", "Tell me about exceptions.")
DEFAULT_TURNS = 6
TEXT_KV = ("fp8", "int4")  # the text demo's sessions: fp8 rows and the 4-bit tier
IDS_KV = ("fp8", "f32")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="suspend/resume a chat across processes, token-exact")
    p.add_argument("--model", default="glm-mini",
                   help="a checkpoint with a tokenizer and chat template (default: the shipped 'glm-mini'), or"
                        " 'tiny' for the byte-level chat of the random tiny model")
    p.add_argument("--root", default=None, help="store directory to use (default: a temporary one)")
    p.add_argument("--turns", type=int, default=DEFAULT_TURNS,
                   help=f"user turns, 2..{len(USER_TURNS)} (default {DEFAULT_TURNS}); every turn after the first runs"
                        " in a new process")
    p.add_argument("--max-new", type=int, default=48, help="tokens generated per turn at most (default 48)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0 = greedy)")
    p.add_argument("--seed", type=int, default=2024, help="sampling seed")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


def _shown(ids: list[int]) -> str:
    """Printable ASCII of byte tokens (the tiny model's weights are random: expect noise)."""
    return "".join(chr(i) if 32 <= i < 127 else "\u00b7" for i in ids)


def _cli(argv: list[str], stdin: str | None = None) -> dict[str, Any]:
    """Run ``coli-kv`` in a separate Python process; returns its last-line JSON."""
    proc = subprocess.run([sys.executable, "-m", "tools", *argv], check=False, capture_output=True, text=True,
                          timeout=600, input=stdin)
    if proc.returncode != 0:
        raise ColiError(f"demo: `coli-kv {' '.join(argv[:1])}` failed in its own process: "
                        f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fresh(store: SessionStore, sid: str) -> None:
    if store.exists(sid):
        store.delete(sid)


# -- the text chat (a model with a tokenizer and a chat template) --------------------------------
def _text_conversation(root: str, model_dir: str, kv: str, sampler: Sampler, max_new: int,
                       questions: tuple[str, ...]) -> dict[str, Any]:
    """Turn 1 here, suspend; every later turn a `coli-kv chat` process resuming from disk."""
    from kernels.model.text import load_text
    from sessionstore.sessions.conversation_chat import Conversation

    store = SessionStore(root)
    sid = f"demo-{kv}"
    _fresh(store, sid)
    t0 = time.perf_counter()
    session = store.create(sid, model_dir, kv_dtype=kv, sampler=sampler)
    first = Conversation.open(session, load_text(model_dir)).say(questions[0], max_new)
    session.suspend()  # committed; memory and lock released: the session is on disk only
    outs, texts, turn_s = [first.tokens], [first.text], [time.perf_counter() - t0]
    for text in questions[1:]:
        t0 = time.perf_counter()
        out = _cli(["chat", "--root", root, "--session", sid, "--max-new", str(max_new), "--json"], stdin=text + "\n")
        turn_s.append(time.perf_counter() - t0)
        outs.append(out["reply"]["tokens"])
        texts.append(out["reply"]["text"])
    info = store.info(sid)
    return {"outputs": outs, "texts": texts, "tokens": info.tokens, "bytes": os.path.getsize(info.kv_path),
            "turn_s": turn_s, "kv_path": info.kv_path}


def _text_reference(model: Any, model_dir: str, kv: str, sampler: Sampler, max_new: int,
                    questions: tuple[str, ...]) -> list[list[int]]:
    """The same conversation in one process, one in-memory cache, no store."""
    from kernels.model.text import load_text
    from sessionstore.sessions.conversation_chat import ReferenceChat

    tok = load_text(model_dir)
    chat = ReferenceChat(model, tok, kv, sampler)
    messages: list[dict[str, Any]] = []
    outs = []
    for text in questions:
        messages.append({"role": "user", "content": text})
        out = chat.respond(messages, max_new)
        outs.append(out)
        messages.append({"role": "assistant", "content": tok.decode(out)})
    return outs


# -- the byte-level chat of the random tiny model --------------------------------------------------
def _ids_conversation(root: str, kv: str, sampler: Sampler, max_new: int, questions: tuple[str, ...]) -> dict[str, Any]:
    store = SessionStore(root)
    sid = f"demo-{kv}"
    _fresh(store, sid)
    prompt = encode_text(questions[0])
    t0 = time.perf_counter()
    session = store.create(sid, "tiny", kv_dtype=kv, sampler=sampler)
    outs = [session.generate(prompt, max_new).tokens]
    session.suspend()
    turn_s = [time.perf_counter() - t0]
    prompts = [prompt]
    for text in questions[1:]:
        prompt = prompts[-1] + outs[-1] + encode_text(" " + text)
        prompts.append(prompt)
        t0 = time.perf_counter()
        out = _cli(["generate", "--root", root, "--session", sid, "--prompt-ids",
                    ",".join(map(str, prompt)), "--max-new", str(max_new), "--json"])
        turn_s.append(time.perf_counter() - t0)
        if out["resume"].get("verified") != "bit-identical":
            raise ColiError(f"demo: resume verification said {out['resume'].get('verified')!r}")
        outs.append(out["tokens"])
    info = store.info(sid)
    return {"outputs": outs, "texts": [_shown(o) for o in outs], "prompts": prompts, "tokens": info.tokens,
            "bytes": os.path.getsize(info.kv_path), "turn_s": turn_s, "kv_path": info.kv_path}


def run(args: argparse.Namespace) -> int:
    from kernels.model import load_model, resolve_model

    if not 2 <= args.turns <= len(USER_TURNS):
        raise ColiError(f"demo: --turns must be between 2 and {len(USER_TURNS)}, found {args.turns}")
    questions = USER_TURNS[:args.turns]
    sampler = Sampler(temperature=args.temperature, top_k=0, top_p=1.0, seed=args.seed)
    text_mode = args.model != "tiny"
    model_dir = str(resolve_model(args.model)) if text_mode else "tiny"
    model = load_model(model_dir)
    root = args.root or tempfile.mkdtemp(prefix="coli-demo-")
    rows: dict[str, Any] = {}
    exact = True
    try:
        for kv in TEXT_KV if text_mode else IDS_KV:
            if text_mode:
                run_ = _text_conversation(root, model_dir, kv, sampler, args.max_new, questions)
                reference = _text_reference(model, model_dir, kv, sampler, args.max_new, questions)
            else:
                run_ = _ids_conversation(root, kv, sampler, args.max_new, questions)
                reference = reference_turns(model, kv, [(p, args.max_new) for p in run_.pop("prompts")], sampler)
            run_["token_exact"] = reference == run_["outputs"]
            exact &= run_["token_exact"]
            rows[kv] = run_
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    first_kv = next(iter(rows))
    name = args.model if text_mode else "the tiny model (random weights, byte vocabulary)"
    print(f"Conversation with {name} ({first_kv} session):")
    for i, (text, reply) in enumerate(zip(questions, rows[first_kv]["texts"], strict=True)):
        print(f"  user {i + 1}: {text}\n  model : {reply.strip()}")
    print()
    print(f"{'kv':<5} {'tokens':>6} {'kv bytes':>9} {'B/token':>8} {'turns (s)':>22} {'exact':>6}")
    for kv, r in rows.items():
        turns = "/".join(f"{t:.2f}" for t in r["turn_s"])
        print(f"{kv:<5} {r['tokens']:>6} {r['bytes']:>9} {r['bytes'] // max(r['tokens'], 1):>8} {turns:>22} "
              f"{'yes' if r['token_exact'] else 'NO':>6}")
    kinds = list(rows)
    ratio = rows[kinds[1]]["bytes"] / max(rows[kinds[0]]["bytes"], 1)
    print(f"kv file bytes {kinds[1]} / {kinds[0]}: {ratio:.2f}; turns 2-{len(questions)} each ran in a new process"
          " resuming from disk")
    print(f"token-exact: {'yes' if exact else 'no'}")
    if args.json:
        print(json.dumps({"token_exact": exact, "model": args.model, "bytes_ratio": {f"{kinds[1]}/{kinds[0]}": ratio},
                          "runs": rows}, sort_keys=True))
    return 0 if exact else 1


__all__ = ["register", "run"]
