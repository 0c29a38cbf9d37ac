"""The session catalogue at scale (FORMAT.md 5.9): store open, the first and a middle page of the
listing, and the first open of a suspended session in stores of 100 / 10,000 / 100,000 sessions,
with the ratios largest / smallest (flat is the goal: none of them scans the store).

How a store is built: one small session (tiny model, fp8, 16 committed records) is created
through the store; then each of the N sessions is made directly as a minimal session directory
the store accepts: ``sessions/<id>/`` with its own manifest (the template's, id rewritten) and
the template's kv file, sidecar and commit state page hard-linked (a fresh copy to link to every
30,000 sessions; the sessions whose first open is timed get real copies). Those directories
appear behind the catalogue's back, so the first open of the store rebuilds it from the
manifests (``rebuild_s``, reported: the one-off cost after a catalogue is lost); the build waits
``RACY_S`` first so that the stamp it records is trusted and every later open takes the fast
path (asserted: ``opened == "fresh"``).

Timings are medians of ``--reps`` runs, each on a fresh ``SessionStore`` object (its model
loaded before the clock starts for the open). ``--quick``: 100 / 1,000 sessions. ``--json``:
one JSON object as the last line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sessionstore.sessions.catalogue import RACY_S
from sessionstore.sessions.directory import SESSIONS_DIR, STATE_NAME
from sessionstore.sessions.manifest import MANIFEST_NAME, read_manifest
from sessionstore.sessions.paths import KV_NAME, SIDECAR_NAME
from sessionstore.sessions.store import SessionStore

FULL_SIZES = (100, 10_000, 100_000)
QUICK_SIZES = (100, 1_000)
PAGE = 20  # sessions per page (OpenAI's default list page; a middle page is full from 100 sessions)
TEMPLATE_PROMPT = list(b"catalogue bench!")  # 16 ids: the template's 16 committed records
LINKED = (KV_NAME, SIDECAR_NAME, STATE_NAME)
LINKS_PER_SOURCE = 30_000  # ext4 allows 65,000 links to one inode: a new source file every 30,000


def sid_of(i: int) -> str:
    return f"s{i:07d}"


def make_template(directory: Path) -> Path:
    """A small committed session made through the store; returns its directory."""
    store = SessionStore(directory / "template")
    s = store.create("tpl", "tiny")
    s.append_tokens(TEMPLATE_PROMPT, commit=True)
    s.close()
    return store.session_dir("tpl")


def build_store(root: Path, template: Path, n: int, copies: set[int]) -> float:
    """``n`` minimal session directories under ``root/sessions`` (module docstring); seconds."""
    t0 = time.perf_counter()
    sessions = root / SESSIONS_DIR
    sessions.mkdir(parents=True)
    manifest = read_manifest(template / MANIFEST_NAME)
    source = template  # the directory whose files the next sessions link to
    for i in range(n):
        sid = sid_of(i)
        d = sessions / sid
        d.mkdir()
        manifest.id = sid
        (d / MANIFEST_NAME).write_bytes(manifest.encode())
        fresh_source = i % LINKS_PER_SOURCE == 0
        for name in LINKED:
            if i in copies or fresh_source:
                shutil.copyfile(template / name, d / name)
            else:
                os.link(source / name, d / name)
        if fresh_source:
            source = d
    return time.perf_counter() - t0


def median_of(fn: Callable[[int], float], reps: int) -> float:
    """The median of ``reps`` timed runs of ``fn(rep)``."""
    return statistics.median(fn(r) for r in range(reps))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_size(directory: Path, template: Path, n: int, reps: int) -> dict[str, Any]:
    root = directory / f"store-{n}"
    probes = [n // 3 + r for r in range(reps)]  # suspended sessions opened once each
    build_s = build_store(root, template, n, set(probes))
    time.sleep(RACY_S + 0.1)  # the rebuild's stamp is then trusted (FORMAT.md 5.9)
    rebuild_s, built = timed(lambda: SessionStore(root))
    assert built.catalogue.opened == "rebuilt" and built.catalogue.count() == n, built.catalogue.opened

    def open_store(_: int) -> float:
        took, s = timed(lambda: SessionStore(root))
        assert s.catalogue.opened == "fresh", s.catalogue.opened
        return float(took)

    store = SessionStore(root)
    middle_after = sid_of(n // 2)

    def page_first(_: int) -> float:
        took, page = timed(lambda: store.page(PAGE))
        assert page.entries[0].id == sid_of(0)
        return float(took)

    def page_middle(_: int) -> float:
        took, page = timed(lambda: store.page(PAGE, middle_after))
        assert page.entries[0].id == sid_of(n // 2 + 1) or n // 2 + 1 >= n
        return float(took)

    def first_open(r: int) -> float:
        fresh = SessionStore(root)
        fresh.load_model("tiny")  # the model is not what this measures
        took, session = timed(lambda: fresh.open(sid_of(probes[r])))
        session.close()
        return float(took)

    entry = store.catalogue.get(sid_of(0))
    assert entry is not None

    def note(_: int) -> float:  # what each commit of a resident session adds: one row written
        took, _none = timed(lambda: store.catalogue.note(entry))
        return float(took)

    out = {"sessions": n, "build_s": build_s, "rebuild_s": rebuild_s,
           "store_open_s": median_of(open_store, reps), "list_first_page_s": median_of(page_first, reps),
           "list_middle_page_s": median_of(page_middle, reps), "first_open_s": median_of(first_open, reps),
           "catalogue_note_s": median_of(note, max(reps, 20)),
           "catalogue_bytes": sum(p.stat().st_size for p in root.glob("catalogue.sqlite3*"))}
    shutil.rmtree(root)
    return out


KEYS = ("store_open_s", "list_first_page_s", "list_middle_page_s", "first_open_s", "catalogue_note_s")


def warm_up(template: Path) -> None:
    """One untimed open and page (imports, the model's first forward, the page cache)."""
    store = SessionStore(template.parent.parent)
    store.open("tpl", "tiny").close()
    store.page(PAGE)


def run(sizes: tuple[int, ...], reps: int, directory: Path) -> dict[str, Any]:
    template = make_template(directory)
    warm_up(template)
    results = [bench_size(directory, template, n, reps) for n in sizes]
    small, large = results[0], results[-1]
    ratios = {f"{k[:-2]}_ratio": large[k] / small[k] for k in KEYS}
    return {"sizes": list(sizes), "ratio_of": f"{sizes[-1]}/{sizes[0]}", "reps": reps, "page": PAGE,
            "built_by": "direct minimal session directories (own manifest; kv, sidecar, state page "
                        "hard-linked from one template session made through the store)",
            **ratios, "results": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} instead of {FULL_SIZES}")
    ap.add_argument("--reps", type=int, default=7, help="timed runs per figure (median)")
    ap.add_argument("--dir", default=None, help="where to build the stores (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-catalogue-") as tmp:
        res = run(sizes, args.reps, Path(tmp))
    for r in res["results"]:
        print(f"{r['sessions']:>7} sessions: open {r['store_open_s'] * 1e3:7.2f} ms  first page "
              f"{r['list_first_page_s'] * 1e3:7.2f} ms  middle page {r['list_middle_page_s'] * 1e3:7.2f} ms  "
              f"first open {r['first_open_s'] * 1e3:7.2f} ms  (build {r['build_s']:.1f} s, rebuild "
              f"{r['rebuild_s']:.2f} s)")
    print("ratios " + res["ratio_of"] + ": " + ", ".join(f"{k} {res[k]:.2f}" for k in res if k.endswith("_ratio")))
    if args.json:
        print(json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
