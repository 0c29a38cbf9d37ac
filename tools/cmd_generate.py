"""``coli-kv generate``: run the reference decoder on prompt token ids and print the generated ids.

Every turn runs on the engine core in this process (:mod:`tools._core`), the loop ``serve --http``
runs its turns on. Without ``--root``/``--session`` the cache lives in memory only. With either of them the whole
command is handed to the session layer (``tools.cmd_sessions.session_generate``), which keeps
the rows in a ``.coli_kv`` file and commits every ``--commit-every`` positions.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kernels.errors import ColiError, FormatError
from kernels.model import Sampler, load_model
from kernels.rows import KV_DTYPES
from sessionstore.sessions import OutputProcessor, TurnEnd
from tools._common import check_backend, parse_ids
from tools._core import InProcessCore
from tools._text import generate_text, text_input

DEFAULT_MAX_NEW = 16


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate tokens with the reference MLA decoder",
        description="Feed prompt token ids to a model (a checkpoint directory or 'tiny') and print the ids it"
        " generates. Exactly --max-new tokens unless --stop-at-eos.",
    )
    p.add_argument("--model", help="checkpoint directory (config.json + *.safetensors) or 'tiny';"
                   " required unless --root/--session is given")
    p.add_argument("--prompt-ids", help="comma-separated input token ids, e.g. 1,2,3 (required unless a session"
                   " continues from its pending token)")
    p.add_argument("--prompt", help="input text, encoded with the model's tokenizer.json (instead of --prompt-ids);"
                   " prints the generated text (and its ids: on stderr, or in --json)")
    p.add_argument("--messages", metavar="FILE.json", help="an OpenAI-style message list (JSON), rendered with the"
                   " model's chat template and the generation prompt; with a session it becomes the session's"
                   " conversation (the reply is appended to it)")
    p.add_argument("--max-new", type=int, default=None, help=f"tokens to generate (default {DEFAULT_MAX_NEW})")
    p.add_argument("--kv", choices=KV_DTYPES, default=None,
                   help="latent cache dtype: f32, fp8, or the 4-bit tier (int4, polar2..polar6) (default: f32 in"
                   " memory; the session layer's default, fp8, with sessions)")
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu", help="attention backend (default cpu)")
    # sampler flags default to None so that a session's stored sampler is only overridden when given
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 = all, default)")
    p.add_argument("--top-p", type=float, default=None, help="keep the smallest set with this probability (1 = all)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default 0); draws depend only on"
                   " (seed, position)")
    p.add_argument("--stop-at-eos", action="store_true", help="stop early when the model emits its eos token")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--root", help="session store root (delegates to the session layer)")
    p.add_argument("--session", help="session id (delegates to the session layer)")
    p.add_argument("--commit-every", type=int, default=64,
                   help="sessions: commit rows every N positions (default 64; 0 = at the end of the turn only)")
    p.add_argument("--remote", default=None,
                   help="sessions: s3://bucket/prefix of a fleet's object store: take the session's lease"
                   " before generating (pulling it if another host pushed it last; refused while another"
                   " host holds it live), keep the lease renewed while generating, push the new commit"
                   " after the turn (a failed push still prints the turn's tokens, then its error)")
    p.add_argument("--host-id", default=None, help="with --remote: who holds leases (default: $COLI_HOST_ID"
                   " or the host name)")
    p.add_argument("--lease-ttl", type=float, default=None, help="with --remote: lease lifetime in seconds")
    p.add_argument("--keep-lease", action="store_true", help="with --remote: keep holding the session after"
                   " the push (default: release it for any host)")
    # the sampling flags above are None unless given: a session keeps its stored value for each one left out
    p.set_defaults(func=handle, explicit_sampler_flags=True)


def sampler_from_args(args: argparse.Namespace) -> Sampler:
    """The sampler the flags ask for (greedy when none is given)."""
    given = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "seed") if getattr(args, k) is not None}
    return Sampler(**given)


def handle(args: argparse.Namespace) -> int:
    text = text_input(args)  # --prompt / --messages, checked before anything is touched
    if args.root or args.session:
        try:
            from tools.cmd_sessions import session_generate
        except ImportError as exc:
            raise ColiError(f"session support is not available here ({exc})") from None
        return session_generate(args)
    if args.remote:
        raise FormatError("--remote needs --root and --session (it moves a session)")
    if not args.model:
        raise FormatError("--model is required (a checkpoint directory or 'tiny') unless --root/--session is given")
    if text is not None:
        check_backend(args.backend)
        max_new = DEFAULT_MAX_NEW if args.max_new is None else args.max_new
        if max_new < 0:
            raise FormatError(f"--max-new: max_new must be an integer >= 0, found {max_new}")
        return generate_text(args, text[0], text[1], sampler_from_args(args), max_new)
    if args.prompt_ids is None:
        raise FormatError("--prompt-ids, --prompt or --messages is required")
    ids = parse_ids(args.prompt_ids)
    sampler = sampler_from_args(args)
    max_new = DEFAULT_MAX_NEW if args.max_new is None else args.max_new
    if max_new < 0:
        raise FormatError(f"--max-new: max_new must be an integer >= 0, found {max_new}")
    check_backend(args.backend)
    kv = args.kv or "f32"
    model = load_model(args.model)
    cache = model.new_cache(kv, backend=args.backend)
    t0 = time.perf_counter()
    with InProcessCore() as core:  # the turn runs on the engine loop, as a served stateless turn
        core.adopt_decoder(model)
        eos = frozenset(model.config.eos_token_ids) if args.stop_at_eos else frozenset()
        reply = core.stateless_turn(cache, ids, max_new, sampler, OutputProcessor(eos=eos))
    tokens, stopped_at_eos = reply.tokens, reply.end is TurnEnd.EOS
    seconds = time.perf_counter() - t0
    print(" ".join(str(t) for t in tokens))
    if args.json:
        print(json.dumps({
            "tokens": tokens,
            "model": model.source,
            "kv": kv,
            "backend": args.backend,
            "prompt_tokens": len(ids),
            "stopped_at_eos": stopped_at_eos,
            "sampler": sampler.to_dict(),
            "seconds": round(seconds, 6),
        }))
    return 0
