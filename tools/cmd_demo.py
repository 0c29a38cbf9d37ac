"""``coli-kv demo``: a multi-turn chat with the embedded tiny model, suspended after the first turn
and resumed in SEPARATE processes for the next ones, compared token for token with the same
conversation run uninterrupted in memory. Prints a short table and ``token-exact: yes`` only
when every token matched (else ``no`` and exit 1)."""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from kernels.errors import ColiError
from sessionstore.sessions import SamplerSettings, SessionStore, reference_turns

USER_TURNS = ("Hello! Who are you?", " Tell me about the sea.", " And what about mountains?")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="suspend/resume a tiny-model chat across processes, token-exact")
    p.add_argument("--root", default=None, help="store directory to use (default: a temporary one)")
    p.add_argument("--max-new", type=int, default=24, help="tokens generated per turn (default 24)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0 = greedy)")
    p.add_argument("--seed", type=int, default=2024, help="sampling seed")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


def _encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _shown(ids: list[int]) -> str:
    """Printable ASCII of byte tokens (the tiny model's weights are random: expect noise)."""
    return "".join(chr(i) if 32 <= i < 127 else "\u00b7" for i in ids)


def _cli(argv: list[str]) -> dict[str, Any]:
    """Run ``coli-kv`` in a separate Python process; returns its last-line JSON."""
    proc = subprocess.run([sys.executable, "-m", "tools", *argv], check=False, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise ColiError(f"demo: `coli-kv {' '.join(argv[:1])}` failed in its own process: "
                        f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _conversation(root: str, kv: str, sampler: SamplerSettings, max_new: int) -> dict[str, Any]:
    """Turn 1 here, suspend; every later turn in a new process that resumes from disk."""
    store = SessionStore(root)
    sid = f"demo-{kv}"
    if store.exists(sid):
        store.delete(sid)
    prompt = _encode(USER_TURNS[0])
    t0 = time.perf_counter()
    session = store.create(sid, "tiny", kv_dtype=kv, sampler=sampler)
    outs = [session.generate(prompt, max_new).tokens]
    session.suspend()  # committed; memory and lock released: the session is on disk only
    turn_s = [time.perf_counter() - t0]
    prompts = [prompt]
    resume_s = []
    for text in USER_TURNS[1:]:
        prompt = prompts[-1] + outs[-1] + _encode(text)
        prompts.append(prompt)
        t0 = time.perf_counter()
        out = _cli(["generate", "--root", root, "--session", sid, "--prompt-ids",
                    ",".join(map(str, prompt)), "--max-new", str(max_new), "--json"])
        turn_s.append(time.perf_counter() - t0)
        resume_s.append(float(out["resume"].get("resume_s", 0.0)))
        if out["resume"].get("verified") != "bit-identical":
            raise ColiError(f"demo: resume verification said {out['resume'].get('verified')!r}")
        outs.append(out["tokens"])
    info = store.info(sid)
    return {"outputs": outs, "prompts": prompts, "tokens": info.tokens, "bytes": info.bytes,
            "turn_s": turn_s, "resume_s": resume_s, "kv_path": info.kv_path}


def run(args: argparse.Namespace) -> int:
    from kernels.model import load_model

    sampler = SamplerSettings(temperature=args.temperature, top_k=0, top_p=1.0, seed=args.seed)
    root = args.root or tempfile.mkdtemp(prefix="coli-demo-")
    model = load_model("tiny")
    rows: dict[str, Any] = {}
    exact = True
    try:
        for kv in ("fp8", "f32"):
            run_ = _conversation(root, kv, sampler, args.max_new)
            t0 = time.perf_counter()
            reference = reference_turns(model, kv, [(p, args.max_new) for p in run_["prompts"]], sampler)
            run_["uninterrupted_s"] = time.perf_counter() - t0
            run_["token_exact"] = reference == run_["outputs"]
            exact &= run_["token_exact"]
            rows[kv] = run_
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    fp8 = rows["fp8"]
    print("Conversation with the tiny model (random weights, byte vocabulary; fp8 session):")
    for i, (text, out) in enumerate(zip(USER_TURNS, fp8["outputs"], strict=True)):
        print(f"  user {i + 1}: {text.strip()}\n  model : {_shown(out)}")
    print()
    print(f"{'kv':<4} {'tokens':>6} {'bytes':>9} {'B/token':>8} {'turns (s)':>22} {'resume (ms)':>14} {'exact':>6}")
    for kv, r in rows.items():
        turns = "/".join(f"{t:.2f}" for t in r["turn_s"])
        resumes = "/".join(f"{t * 1e3:.1f}" for t in r["resume_s"])
        print(f"{kv:<4} {r['tokens']:>6} {r['bytes']:>9} {r['bytes'] // max(r['tokens'], 1):>8} {turns:>22} "
              f"{resumes:>14} {'yes' if r['token_exact'] else 'NO':>6}")
    ratio = rows["f32"]["bytes"] / max(rows["fp8"]["bytes"], 1)
    print(f"fp8 rows take {ratio:.2f}x less disk than f32; turns 2-3 each ran in a new process "
          "resuming from disk")
    print(f"token-exact: {'yes' if exact else 'no'}")
    if args.json:
        print(json.dumps({"token_exact": exact, "bytes_ratio_f32_over_fp8": ratio,
                          "runs": {kv: {k: v for k, v in r.items() if k != "prompts"} for kv, r in rows.items()}},
                         sort_keys=True))
    return 0 if exact else 1


__all__ = ["register", "run"]
