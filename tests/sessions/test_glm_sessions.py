"""GLM-5 (glm_moe_dsa) sessions: token-exact across processes and after real SIGKILLs, with every
kv dtype, and every mover (fork, bundle, engine slot, convert) carrying the Ic (indexer) rows.

The tiny GLM checkpoint has ``index_topk`` 16 and two full + two shared indexer layers; every
prompt here is longer than 16 tokens, so sparse selection runs on every step.
"""
from __future__ import annotations

import io
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from kernels.model import load_model
from kernels.model.sampling import Sampler
from sessionstore.kvfile import convert_file, open_kv
from sessionstore.migration import export_session, migrate
from sessionstore.sessions import SessionOptions
from sessionstore.sessions.slots import export_slot, import_slot
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turn_loop import reference_turns
from tests.support.session_util import run_child, spawn_child

PROMPT = list(b"The indexer picks the rows that matter most.")  # 44 tokens > index_topk 16
EDITED = PROMPT[:30] + list(b" and then?")
SAMPLERS = {"greedy": (0.0, 0, 1.0, 0), "sampled": (0.8, 40, 0.95, 777)}


@pytest.fixture(scope="module")
def glm(tiny_glm_dir: Path):  # a GLM decoder
    return load_model(tiny_glm_dir)


@pytest.mark.parametrize("kv", ["f32", "fp8", "int4", "polar4"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_glm_turns_across_processes_are_token_exact(tmp_path: Path, glm, tiny_glm_dir: Path, kv: str,
                                                    mode: str) -> None:
    """Each turn in a new process (create, continue, an edited earlier prompt): the same tokens
    as one uninterrupted in-memory run."""
    sampler = Sampler(*SAMPLERS[mode])
    root = str(tmp_path / "root")
    jobs = [{"id": "g", "create": {"kv": kv, "model": str(tiny_glm_dir), "sampler": list(SAMPLERS[mode])},
             "prompt": PROMPT, "max_new": 10, "commit_every": 3},
            {"id": "g", "max_new": 7},
            {"id": "g", "prompt": EDITED, "max_new": 6}]
    got = [run_child({"root": root, "jobs": [job]})["g"] for job in jobs]
    expected = reference_turns(glm, kv, [(PROMPT, 10), (None, 7), (EDITED, 6)], sampler)
    assert [r["tokens"] for r in got] == expected
    assert got[1]["resume"]["verified"] in ("bit-identical", "recomputed (no digest to compare)")
    with open_kv(SessionStore(root).kv_path("g")) as reader:  # Ic rows for every position
        assert reader.dims.n_index_layers == 2 and reader.dims.index_head_dim > 0
        assert reader.nrec == len(EDITED) + 5
        assert np.all(np.isfinite(reader.index_block())) and np.any(reader.index_block() != 0)


@pytest.mark.parametrize("kv, mode", [("fp8", "sampled"), ("int4", "greedy"), ("polar4", "sampled"),
                                      ("f32", "greedy")])
def test_glm_sigkill_mid_decode_resumes_exactly(tmp_path: Path, glm, tiny_glm_dir: Path, kv: str,
                                                mode: str) -> None:
    rng = random.Random(f"glm-{kv}-{mode}")
    sampler = Sampler(*SAMPLERS[mode])
    total, commit_every, root = 60, rng.choice([1, 2]), str(tmp_path)
    for kill in range(2):
        job = {"id": "s", "max_new": total, "commit_every": commit_every}
        if kill == 0:
            job.update(create={"kv": kv, "model": str(tiny_glm_dir), "sampler": list(SAMPLERS[mode])},
                       prompt=PROMPT)
        else:
            history = SessionStore(root).history("s")
            job["max_new"] = total - (len(history) - len(PROMPT))
        proc = spawn_child({"root": root, "jobs": [job], "stream": True})
        seen, stop_after = 0, rng.randint(3, 15)
        while seen < stop_after:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            seen += line.startswith("tok ")
        time.sleep(rng.random() * 0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
    stream = PROMPT + reference_turns(glm, kv, [(PROMPT, total)], sampler)[0]
    s = SessionStore(root).open("s")
    history = s.history()
    assert len(history) > len(PROMPT) and history == stream[:len(history)]
    assert s.generate(None, total - (len(history) - len(PROMPT))).tokens == stream[len(history):]
    s.close()


def _index_rows(store: SessionStore, sid: str) -> np.ndarray:
    with open_kv(store.kv_path(sid)) as reader:
        block = reader.index_block()
        assert block is not None
        return np.array(block)  # [n, NI, hd] f32


@pytest.mark.parametrize("kv", ["fp8", "int4"])
def test_every_mover_carries_the_indexer_rows(tmp_path: Path, glm, tiny_glm_dir: Path, kv: str) -> None:
    sampler = Sampler(*SAMPLERS["sampled"])
    store = SessionStore(tmp_path / "a")
    src = store.create("src", tiny_glm_dir, kv_dtype=kv, sampler=sampler, options=SessionOptions(commit_every=4))
    full = src.generate(PROMPT, 12).tokens
    n = len(PROMPT) + 5
    src.fork("f", at=n)
    src.close()
    ic = _index_rows(store, "src")  # [len(PROMPT) + 11, NI, hd]
    # fork: the first n rows, and the fork regenerates the source's tokens after n
    assert np.array_equal(_index_rows(store, "f"), ic[:n])
    f = store.open("f")
    assert f.generate(None, 6).tokens == full[6:12]
    f.close()
    # bundle: export from host A, import on host B, continue like the uninterrupted run
    buf = io.BytesIO()
    export_session(store, "src", buf)
    other = SessionStore(tmp_path / "b")
    migrate.import_bundle(other, io.BytesIO(buf.getvalue()), model=str(tiny_glm_dir))
    assert np.array_equal(_index_rows(other, "src"), ic)
    expected = reference_turns(glm, kv, [(PROMPT, 12), (None, 5)], sampler)[1]
    moved = other.open("src")
    assert moved.generate(None, 5).tokens == expected
    moved.close()
    # engine slot: export the session as the model dir's slot file, import it back as a session
    slot_model = tmp_path / "slot-model"
    slot_model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (slot_model / name).write_bytes((tiny_glm_dir / name).read_bytes())
    path = export_slot(store, "src", slot_model, slot=1)
    with open_kv(path) as reader:
        assert np.array_equal(reader.index_block(), ic)
    import_slot(store, slot_model, slot=1, session_id="from-slot")
    assert np.array_equal(_index_rows(store, "from-slot"), ic)
    # convert: every tier keeps the Ic rows exactly (they are never quantised)
    for to, codec in (("v1", None), ("v3", None)):
        convert_file(store.kv_path("src"), tmp_path / f"conv-{to}", to, codec=codec)
        with open_kv(tmp_path / f"conv-{to}") as reader:
            assert np.array_equal(reader.index_block(), ic)
