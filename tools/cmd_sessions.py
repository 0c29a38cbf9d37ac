"""Session commands: ``coli-kv ls | rm | fork`` (all with ``--root DIR``), and ``session_generate``,
which ``coli-kv generate --root R --session ID ...`` runs (tools/cmd_generate.py calls it)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kernels.errors import FormatError
from sessionstore.manifest import SamplerSettings
from sessionstore.session import DEFAULT_COMMIT_EVERY
from sessionstore.store import SessionStore


def register(subparsers: Any) -> None:
    ls = subparsers.add_parser("ls", help="list the sessions of a store")
    ls.add_argument("--root", required=True, help="the session store directory")
    ls.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ls.set_defaults(func=run_ls)

    rm = subparsers.add_parser("rm", help="delete a session (refused while a writer holds it)")
    rm.add_argument("session_id", metavar="ID")
    rm.add_argument("--root", required=True, help="the session store directory")
    rm.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    rm.set_defaults(func=run_rm)

    fork = subparsers.add_parser("fork", help="copy a session's first N records into a new session")
    fork.add_argument("session_id", metavar="ID")
    fork.add_argument("new_id", metavar="NEW")
    fork.add_argument("--at", type=int, default=None, help="records to keep (default: all committed)")
    fork.add_argument("--root", required=True, help="the session store directory")
    fork.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    fork.set_defaults(func=run_fork)


def _emit(args: argparse.Namespace, text: str, obj: dict[str, Any]) -> None:
    print(text)
    if getattr(args, "json", False):
        print(json.dumps(obj, sort_keys=True))


def run_ls(args: argparse.Namespace) -> int:
    store = SessionStore(args.root, create=False)
    infos = store.list()
    lines = [f"{'ID':<24} {'TOKENS':>8} {'KV':<4} {'BYTES':>12}  MODEL"]
    lines += [f"{i.id:<24} {i.tokens:>8} {i.kv_dtype:<4} {i.bytes:>12}  {i.model}" for i in infos]
    _emit(args, "\n".join(lines), {"root": str(store.root), "sessions": [i.to_json() for i in infos]})
    return 0


def run_rm(args: argparse.Namespace) -> int:
    store = SessionStore(args.root, create=False)
    store.delete(args.session_id)
    _emit(args, f"removed {args.session_id}", {"removed": args.session_id})
    return 0


def run_fork(args: argparse.Namespace) -> int:
    store = SessionStore(args.root, create=False)
    info = store.fork(args.session_id, args.new_id, at=args.at)
    _emit(args, f"forked {args.session_id} -> {info.id} ({info.tokens} records)",
          {"forked": args.session_id, **info.to_json()})
    return 0


# ---- generate --root R --session ID --------------------------------------------------------------
def _opt(args: argparse.Namespace, name: str) -> Any:
    return getattr(args, name, None)


def _prompt_ids(args: argparse.Namespace) -> list[int] | None:
    raw = _opt(args, "prompt_ids")
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            return [int(t) for t in raw.replace(" ", "").split(",") if t != ""]
        except ValueError:
            raise FormatError(f"--prompt-ids: expected comma-separated integers, found {raw!r}") from None
    return [int(t) for t in raw]


def _sampler(args: argparse.Namespace, base: SamplerSettings) -> SamplerSettings:
    """The session's sampler with the flags given on this command line applied over it.

    A flag left at its default (None, or the parser's neutral value: temperature 0, top-k 0,
    top-p 1, seed 0) keeps the session's setting, so a resume without sampling flags continues
    with the settings the session was created with.
    """
    neutral = SamplerSettings()
    fields = {}
    for name in ("temperature", "top_k", "top_p", "seed"):
        value = _opt(args, name)
        if value is not None and value != getattr(neutral, name):
            fields[name] = value
    merged = {**base.__dict__, **fields}
    return SamplerSettings(float(merged["temperature"]), int(merged["top_k"]), float(merged["top_p"]),
                           int(merged["seed"]))


def session_generate(args: argparse.Namespace) -> int:
    """Create the session if absent, else resume it; run one turn; commit; print the tokens."""
    if not _opt(args, "root") or not _opt(args, "session"):
        raise FormatError("--root and --session go together")
    store = SessionStore(args.root)
    commit_every = _opt(args, "commit_every")
    options = dict(commit_every=DEFAULT_COMMIT_EVERY if commit_every is None else int(commit_every),
                   backend=_opt(args, "backend") or "cpu")
    prompt = _prompt_ids(args)
    created = not store.exists(args.session)
    if created:
        model = _opt(args, "model")
        if not model:
            raise FormatError(f"session {args.session!r} does not exist: --model is needed to create it")
        if prompt is None:
            raise FormatError(f"session {args.session!r} is new: --prompt-ids is needed")
        session = store.create(args.session, model, kv_dtype=_opt(args, "kv") or "fp8",
                               sampler=_sampler(args, SamplerSettings()), **options)
    else:
        session = store.open(args.session, _opt(args, "model") or None, **options)
    try:
        kv = _opt(args, "kv")
        if kv is not None and kv != session.manifest.kv_dtype:
            raise FormatError(f"session {args.session!r} stores {session.manifest.kv_dtype} rows, "
                              f"--kv {kv} given (convert with fork/export, or drop --kv)")
        max_new = _opt(args, "max_new")
        result = session.generate(prompt, 16 if max_new is None else int(max_new),
                                  stop_at_eos=bool(_opt(args, "stop_at_eos")),
                                  sampler=_sampler(args, session.manifest.sampler))
        resume = {k: v for k, v in session.resume_report.items() if k != "detail"}
        summary = {"tokens": result.tokens, "session": args.session, "created": created,
                   "reused_prefix": result.reused_prefix, "fed": result.fed,
                   "committed": result.committed, "pending": list(session.pending),
                   "stopped_at_eos": result.stopped_at_eos, "kv_dtype": session.manifest.kv_dtype,
                   "kv_path": str(session.kv_path), "resume": resume, "seconds": result.seconds}
    finally:
        session.close()
    print(",".join(str(t) for t in result.tokens))
    if _opt(args, "json"):
        print(json.dumps(summary, sort_keys=True))
    else:
        print(f"session {args.session}: {'created' if created else 'resumed'}, reused "
              f"{result.reused_prefix}, committed {result.committed} records", file=sys.stderr)
    return 0


__all__ = ["register", "run_ls", "run_rm", "run_fork", "session_generate"]
