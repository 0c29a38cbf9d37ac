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

Timings are medians of ``--reps`` rounds; each round samples every size in turn (store open on a
fresh ``SessionStore`` object, the two pages on one kept open, the first open on a fresh object
whose model is loaded before the clock starts, three catalogue row writes). ``--quick``: 100 /
1,000 sessions. ``--json``: one JSON object as the last line.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import json_line
from sessionstore.sessions.catalogue import RACY_S
from sessionstore.sessions.catalogue_schema import CATALOGUE_NAME
from sessionstore.sessions.directory import SESSIONS_DIR, STATE_NAME
from sessionstore.sessions.manifest import MANIFEST_NAME, read_manifest
from sessionstore.sessions.paths import KV_NAME, SIDECAR_NAME
from sessionstore.sessions.store import SessionStore

FULL_SIZES = (100, 10_000, 100_000)
QUICK_SIZES = (100, 1_000)
PAGE = 20  # sessions per page (OpenAI's default list page; a middle page is full from 100 sessions)
TEMPLATE_PROMPT = list(b"catalogue bench!")  # 16 ids: the template's 16 committed records
LINKED = (KV_NAME, SIDECAR_NAME, STATE_NAME)
KEYS = ("store_open_s", "list_first_page_s", "list_middle_page_s", "first_open_s", "catalogue_note_s")
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


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class SizedStore:
    """One built store of ``n`` sessions and its timed operations (one call = one sample)."""

    def __init__(self, directory: Path, template: Path, n: int, reps: int) -> None:
        self.n = n
        self.root = directory / f"store-{n}"
        self.probes = [n // 3 + r for r in range(reps)]  # suspended sessions opened once each
        self.build_s = build_store(self.root, template, n, set(self.probes))
        self.rebuild_s = 0.0
        self.samples: dict[str, list[float]] = {k: [] for k in KEYS}

    def rebuild(self) -> None:
        """The first open: the catalogue made from the manifests (the directories came behind its back)."""
        self.rebuild_s, built = timed(lambda: SessionStore(self.root).catalogue)
        assert built.opened == "rebuilt" and built.count() == self.n, built.opened
        self.store = SessionStore(self.root)
        entry = self.store.catalogue.get(sid_of(0))
        assert entry is not None
        self.entry = entry

    def sample(self, r: int) -> None:
        """One sample of every figure; ``r`` picks the session whose first open is timed."""
        took, s = timed(lambda: SessionStore(self.root).catalogue)  # the catalogue opens on first use
        assert s.opened == "fresh", s.opened
        self.samples["store_open_s"].append(took)
        took, page = timed(lambda: self.store.page(PAGE))
        assert page.entries[0].id == sid_of(0)
        self.samples["list_first_page_s"].append(took)
        took, page = timed(lambda: self.store.page(PAGE, sid_of(self.n // 2)))
        assert page.entries[0].id == sid_of(self.n // 2 + 1)
        self.samples["list_middle_page_s"].append(took)
        fresh = SessionStore(self.root)
        fresh.load_model("tiny")  # the model is not what this measures
        took, session = timed(lambda: fresh.open(sid_of(self.probes[r])))
        session.close()
        self.samples["first_open_s"].append(took)
        for _ in range(3):  # what each commit of a resident session adds: one row written
            took, _none = timed(lambda: self.store.catalogue.note(self.entry))
            self.samples["catalogue_note_s"].append(took)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sessions": self.n, "build_s": self.build_s, "rebuild_s": self.rebuild_s}
        out.update({k: statistics.median(v) for k, v in self.samples.items()})
        out["catalogue_bytes"] = sum(p.stat().st_size for p in self.root.glob(CATALOGUE_NAME + "*"))
        return out


def warm_up(template: Path) -> None:
    """One untimed open and page (imports, the model's first forward, the page cache)."""
    store = SessionStore(template.parent.parent)
    store.open("tpl", "tiny").close()
    store.page(PAGE)


def run(sizes: tuple[int, ...], reps: int, directory: Path) -> dict[str, Any]:
    """Build every store, rebuild each catalogue, then sample the sizes in turn, ``reps`` rounds
    (a load that comes and goes on the machine falls on every size alike)."""
    template = make_template(directory)
    warm_up(template)
    stores = [SizedStore(directory, template, n, reps) for n in sizes]
    time.sleep(RACY_S + 0.1)  # the rebuilds' stamps are then trusted (FORMAT.md 5.9)
    for st in stores:
        st.rebuild()
    for r in range(reps):
        for st in stores:
            st.sample(r)
    results = [st.result() for st in stores]
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
    return json_line(res, args.json, sort_keys=True)


if __name__ == "__main__":
    raise SystemExit(main())
