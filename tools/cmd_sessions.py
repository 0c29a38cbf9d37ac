"""Session commands: ``coli-kv ls | rm | fork`` (all with ``--root DIR``), and ``session_generate``,
which ``coli-kv generate --root R --session ID ...`` runs (tools/cmd_generate.py calls it)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any

from kernels.errors import ColiError, FormatError
from kernels.model import resolve_model
from kernels.model.sampling import Sampler
from sessionstore.sessions import (
    DEFAULT_COMMIT_EVERY,
    MAX_PAGE,
    ORDERS,
    SessionFilesMissingError,
    SessionOptions,
    SessionStore,
    TurnEnd,
)
from tools._common import check_backend, parse_ids, push_turn, remove_empty_store
from tools._core import InProcessCore
from tools._text import session_text_turn, text_input, tokenizer_for


def register(subparsers: Any) -> None:
    ls = subparsers.add_parser("ls", help="list the sessions of a store")
    ls.add_argument("--root", required=True, help="the session store directory")
    ls.add_argument("--limit", type=int, default=None,
                    help=f"one page of at most N sessions, 1..{MAX_PAGE} (default: every session)")
    ls.add_argument("--after", metavar="ID", default=None,
                    help="start after this id (the previous page's last id; need not exist now)")
    ls.add_argument("--order", choices=ORDERS, default="asc", help="id order (default: asc)")
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


def _listed(store: SessionStore, args: argparse.Namespace) -> tuple[list[str], bool]:
    """The ids of one page (``--limit``), or of every session paged through the catalogue, in
    ``--order`` after ``--after``; and whether more follow."""
    if args.limit is not None:
        page = store.page(args.limit, args.after, args.order)
        return [e.id for e in page.entries], page.has_more
    ids: list[str] = []
    after, has_more = args.after, True
    while has_more:
        page = store.page(MAX_PAGE, after, args.order)
        ids += [e.id for e in page.entries]
        has_more = page.has_more
        after = page.entries[-1].id if page.entries else after
    return ids, False


def run_ls(args: argparse.Namespace) -> int:
    """The table of sessions (from the store's catalogue, each re-read from its files); one whose
    manifest cannot be read is listed as UNREADABLE, one the catalogue lists whose files are gone
    as MISSING, each with the reason (never silently left out; ``rm`` removes either)."""
    store = SessionStore(args.root, create=False)
    ids, has_more = _listed(store, args)
    infos, unreadable = [], []
    for sid in ids:
        try:
            infos.append(store.info(sid))
        except SessionFilesMissingError as exc:
            unreadable.append({"id": sid, "state": "missing", "error": str(exc)})
        except (ColiError, OSError) as exc:
            unreadable.append({"id": sid, "state": "unreadable", "error": str(exc)})
    lines = [f"{'ID':<24} {'TOKENS':>8} {'KV':<4} {'BYTES':>12}  MODEL"]
    lines += [f"{i.id:<24} {i.tokens:>8} {i.kv_dtype:<4} {i.bytes:>12}  {i.model}" for i in infos]
    lines += [f"{u['id']:<24} {u['state'].upper()}: {u['error']}" for u in unreadable]
    if has_more:
        lines.append(f"(more after {ids[-1]}: --after {ids[-1]})")
    _emit(args, "\n".join(lines), {"root": str(store.root), "sessions": [i.to_json() for i in infos],
                                   "unreadable": unreadable, "order": args.order,
                                   "first_id": ids[0] if ids else None, "last_id": ids[-1] if ids else None,
                                   "has_more": has_more})
    return 0


def run_rm(args: argparse.Namespace) -> int:
    store = SessionStore(args.root, create=False, sweep=True)  # writes: sweep dead temporaries
    store.delete(args.session_id)
    _emit(args, f"removed {args.session_id}", {"removed": args.session_id})
    return 0


def run_fork(args: argparse.Namespace) -> int:
    store = SessionStore(args.root, create=False, sweep=True)  # writes: sweep dead temporaries
    info = store.fork(args.session_id, args.new_id, at=args.at)  # the conversation goes along (snapshot.copy_to)
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
        return parse_ids(raw)
    return [int(t) for t in raw]


def _sampler(args: argparse.Namespace, base: Sampler) -> Sampler:
    """The session's sampler with the flags given on this command line applied over it, checked
    (one clear error) before anything is written: an invalid value stored in the manifest would
    make the session unreadable.

    From the ``generate`` parser (``explicit_sampler_flags``) only a flag left out (None) keeps
    the session's setting, so ``--temperature 0`` switches a sampling session to greedy. A
    namespace built by other callers also keeps the session's setting for the neutral values
    (temperature 0, top-k 0, top-p 1, seed 0).
    """
    neutral = Sampler()
    explicit = bool(_opt(args, "explicit_sampler_flags"))
    fields = {}
    for name in ("temperature", "top_k", "top_p", "seed"):
        value = _opt(args, name)
        if value is not None and (explicit or value != getattr(neutral, name)):
            fields[name] = value
    merged = {**asdict(base), **fields}
    return Sampler.checked(**merged)  # raises FormatError naming the bad setting


def _discard_if_empty(store: SessionStore, session_id: str) -> None:
    """Remove a session this command created when its first turn failed before any commit, so a
    refused command leaves no trace; never masks the original error."""
    try:
        if store.info(session_id).tokens == 0:
            store.delete(session_id)
    except (ColiError, OSError):
        pass


def _release_quietly(remote: Any, session_id: str) -> None:
    """Give back a lease this command took before it failed (never masks the failure)."""
    try:
        lease = remote.lease(session_id)
        if lease is not None and lease.owner == remote.host_id and not lease.released:
            remote.release(session_id)
    except Exception:  # the store may be unreachable: the first error is the one to show
        pass


def _turn_options(args: argparse.Namespace) -> tuple[int, SessionOptions]:
    """(max_new, session options) from the flags, every one checked before the store is touched."""
    commit_every = _opt(args, "commit_every")
    commit_every = DEFAULT_COMMIT_EVERY if commit_every is None else int(commit_every)
    if commit_every < 0:
        raise FormatError(f"--commit-every must be >= 0 (0 = at the end of the turn), found {commit_every}")
    max_new = _opt(args, "max_new")
    max_new = 16 if max_new is None else int(max_new)
    if max_new < 0:
        raise FormatError(f"--max-new: max_new must be an integer >= 0, found {max_new}")
    backend = _opt(args, "backend") or "cpu"
    check_backend(backend)
    return max_new, SessionOptions(commit_every=commit_every, backend=backend)


def _remote(store: SessionStore, args: argparse.Namespace) -> Any:
    """The fleet's object store for ``--remote`` (None without it)."""
    url = _opt(args, "remote")
    if not url:
        return None
    from sessionstore.migration import LEASE_TTL_S, RemoteStore

    ttl = _opt(args, "lease_ttl")
    return RemoteStore(store, url, host_id=_opt(args, "host_id"),
                       lease_ttl=LEASE_TTL_S if ttl is None else ttl)


def _model_source(store: SessionStore, args: argparse.Namespace) -> str | None:
    """The model the session decodes with: ``--model``, else the session's own (None while neither
    is known here: a new session without --model, or one the fleet has not pulled yet)."""
    model = _opt(args, "model")
    if model:
        return resolve_model(model)
    if store.exists(args.session):
        return store.read_manifest(args.session).model.path
    return None


def _open_or_create(store: SessionStore, args: argparse.Namespace, prompt: list[int] | None,
                    options: SessionOptions) -> tuple[Any, bool]:
    """(session, created): resume ``args.session``, or create it when absent."""
    model = _opt(args, "model")
    model = resolve_model(model) if model else None  # "glm-mini": the shipped checkpoint directory
    if store.exists(args.session):
        return store.open(args.session, model, options), False
    if not model:
        raise FormatError(f"session {args.session!r} does not exist: --model is needed to create it")
    if prompt is None:
        raise FormatError(f"session {args.session!r} is new: --prompt-ids is needed")
    session = store.create(args.session, model, kv_dtype=_opt(args, "kv") or "fp8",
                           sampler=_sampler(args, Sampler()), options=options)
    return session, True


def _run_turn(session: Any, args: argparse.Namespace, prompt: list[int] | None, max_new: int,
              created: bool) -> tuple[list[int], dict[str, Any]]:
    kv = _opt(args, "kv")
    if kv is not None and kv != session.manifest.kv_dtype:
        raise FormatError(f"session {args.session!r} stores {session.manifest.kv_dtype} rows, "
                          f"--kv {kv} given (convert with fork/export, or drop --kv)")
    result = session.generate(prompt, max_new, stop_at_eos=bool(_opt(args, "stop_at_eos")),
                              sampler=_sampler(args, session.manifest.sampler))
    resume = {k: v for k, v in session.resume_report.items() if k != "detail"}
    return result.tokens, {
        "tokens": result.tokens, "session": args.session, "created": created,
        "reused_prefix": result.reused_prefix, "fed": result.fed, "committed": result.committed,
        "pending": list(session.pending), "stopped_at_eos": result.end is TurnEnd.EOS,
        "kv_dtype": session.manifest.kv_dtype, "kv_path": str(session.kv_path), "resume": resume,
        "seconds": result.seconds}


def session_generate(args: argparse.Namespace) -> int:
    """Create the session if absent, else resume it; run one turn; commit; print the tokens.
    A refused command leaves the store as it was (no empty session, no empty store skeleton)."""
    if not _opt(args, "root") or not _opt(args, "session"):
        raise FormatError("--root and --session go together")
    text = text_input(args)  # --prompt / --messages: read and checked before the store is touched
    if text is not None:
        return session_generate_text(args, *text)
    max_new, options = _turn_options(args)
    prompt = _prompt_ids(args)
    fresh_root = not os.path.lexists(args.root)
    store = SessionStore(args.root)
    created = leasing = ok = False
    remote = None
    push_error: ColiError | None = None
    core = InProcessCore()  # the turn is a job on the engine loop, as a served one
    try:
        remote = _remote(store, args)
        core.adopt_store_model(store, _model_source(store, args))
        options = core.session_options(options)

        def turn() -> tuple[list[int], dict[str, Any]]:
            nonlocal created, leasing
            if remote is not None:  # the lease first (pulled unless held here), a keeper renews it
                session, created = remote.begin_turn(
                    args.session, lambda: _open_or_create(store, args, prompt, options),
                    _opt(args, "model") or None, options)
                leasing = True
            else:
                session, created = _open_or_create(store, args, prompt, options)
            try:
                return _run_turn(session, args, prompt, max_new, created)
            finally:
                session.close()

        tokens, summary = core.call(turn)
        ok = True
        if remote is not None:  # the turn is committed here; now the fleet gets it
            summary["remote"], push_error = push_turn(remote, args.session,
                                                      bool(_opt(args, "keep_lease")))
    finally:
        core.stop()
        if not ok:
            if leasing:  # the fleet keeps its last pushed bundle; another host may take it now
                _release_quietly(remote, args.session)
            if created:
                _discard_if_empty(store, args.session)
            if fresh_root:
                remove_empty_store(str(store.root))
    print(",".join(str(t) for t in tokens))
    if _opt(args, "json"):
        print(json.dumps(summary, sort_keys=True))
    if push_error is not None:  # after the tokens: the turn is committed on this host only
        raise push_error
    if not _opt(args, "json"):
        state = "created" if created else "resumed"
        if summary["resume"].get("recovered"):
            state += (" after recovery (an interrupted or cut file: continued from its "
                      f"{summary['resume'].get('committed', '?')} complete committed records)")
        pushed = (f"; pushed to {summary['remote']['url']}, lease {summary['remote']['lease']}"
                  if "remote" in summary else "")
        print(f"session {args.session}: {state}, reused {summary['reused_prefix']}, committed "
              f"{summary['committed']} records{pushed}", file=sys.stderr)
    return 0


def session_generate_text(args: argparse.Namespace, kind: str, value: Any) -> int:
    """``generate --root R --session ID --prompt TEXT | --messages FILE``: the tokenizer and the
    prompt are checked before the session is created or changed; a refused turn leaves no trace."""
    if _opt(args, "remote"):
        raise FormatError("--remote takes token-level turns (--prompt-ids) only")
    max_new, options = _turn_options(args)
    fresh_root = not os.path.lexists(args.root)
    store = SessionStore(args.root)
    created = ok = False
    core = InProcessCore()  # the turn is a job on the engine loop, as a served one
    try:
        if store.exists(args.session):
            source = _opt(args, "model") or store.read_manifest(args.session).model.path
            tok = tokenizer_for(source)
        elif not _opt(args, "model"):
            raise FormatError(f"session {args.session!r} does not exist: --model is needed to create it")
        else:
            tok = tokenizer_for(args.model)
        core.adopt_store_model(store, _model_source(store, args))
        options = core.session_options(options)

        def turn() -> dict[str, Any]:
            nonlocal created
            if store.exists(args.session):
                model = _opt(args, "model")
                session = store.open(args.session, resolve_model(model) if model else None, options)
            else:
                session = store.create(args.session, resolve_model(args.model), kv_dtype=_opt(args, "kv") or "fp8",
                                       sampler=_sampler(args, Sampler()), options=options)
                created = True
            try:
                return session_text_turn(session, args, kind, value, tok, max_new,
                                         _sampler(args, session.manifest.sampler))
            finally:
                session.close()

        summary = core.call(turn)
        ok = True
    finally:
        core.stop()
        if not ok:
            if created:
                _discard_if_empty(store, args.session)
            if fresh_root:
                remove_empty_store(str(store.root))
    print(summary["text"])
    summary.update(session=args.session, created=created)
    if _opt(args, "json"):
        print(json.dumps(summary, sort_keys=True, ensure_ascii=False))
    else:
        print(f"ids: {' '.join(str(t) for t in summary['tokens'])}", file=sys.stderr)
        print(f"session {args.session}: {'created' if created else 'resumed'}, reused {summary['reused_prefix']}, "
              f"committed {summary['committed']} records", file=sys.stderr)
    return 0


__all__ = ["register", "run_fork", "run_ls", "run_rm", "session_generate", "session_generate_text"]
