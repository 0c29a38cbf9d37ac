"""Engine slots: import-slot / export-slot (byte-compatible, atomic) and the CLI around them."""
from __future__ import annotations

import json
import os

import pytest

from kernels.errors import FormatError, ModelMismatchError, NotFoundError
from kernels.model import load_model
from kernels.model.sampling import Sampler
from sessionstore.kvfile.header import Dims, Header, pack_header
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.writer import KVWriter
from sessionstore.sessions.slots import export_slot, import_slot, slot_path
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.turn_loop import feed_chunk, reference_turns
from tests.support.session_util import write_tiny_checkpoint
from tools.coli_kv import main

PROMPT = list(b"slot prompt, engine side")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-ckpt")


def _engine_slot(model_dir, slot: int, kv: str, prompt=PROMPT) -> None:
    """A slot file as the engine leaves it: records of the fed prompt, no sidecar, no pending token."""
    model = load_model(model_dir)
    cache = model.new_cache(kv)
    feed_chunk(model, cache, prompt)
    path = slot_path(model_dir, slot)
    with KVWriter.open(path, Dims(*model.dims_for_file()), kv_dtype=kv, checksums=False) as w:
        w.append(cache.records_since(0))
    assert not os.path.exists(str(path) + ".colisum")


def test_slot_paths(tmp_path) -> None:
    assert slot_path(tmp_path) == tmp_path / ".coli_kv"
    assert slot_path(tmp_path, 3) == tmp_path / ".coli_kv.3"
    for bad in (-1, 10_000, True, "1"):
        with pytest.raises(FormatError):
            slot_path(tmp_path, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("kv, slot", [("fp8", 0), ("f32", 2), ("int4", 3), ("polar4", 1)])
def test_import_continues_like_an_uninterrupted_run(tmp_path, model_dir, kv, slot) -> None:
    _engine_slot(model_dir, slot, kv)
    store = SessionStore(tmp_path / "store")
    info = import_slot(store, model_dir, slot=slot, session_id="imp")
    assert info.tokens == len(PROMPT) and info.kv_dtype == kv and info.pending == []
    s = store.open("imp")
    assert s.resume_report["verified"] == "recomputed (no digest to compare)"
    assert s.resume_report["rows_exact"] is True
    out = s.generate(None, 8).tokens
    s.close()
    assert out == reference_turns(load_model(model_dir), kv, [(PROMPT, 8)], Sampler())[0]
    with pytest.raises(FormatError, match="already exists"):
        import_slot(store, model_dir, slot=slot, session_id="imp")
    import_slot(store, model_dir, slot=slot, session_id="imp", replace=True)
    os.unlink(slot_path(model_dir, slot))


def test_import_refuses_other_dims_and_missing(tmp_path, model_dir) -> None:
    store = SessionStore(tmp_path / "store")
    with pytest.raises(NotFoundError):
        import_slot(store, model_dir, slot=7)
    path = slot_path(model_dir, 7)
    path.write_bytes(pack_header(Header(2, Dims(2, 8, 4, 0, 0, 260), 0)))
    try:
        with pytest.raises(ModelMismatchError):
            import_slot(store, model_dir, slot=7)
    finally:
        path.unlink()
    assert store.directory.list() == []


@pytest.mark.parametrize("kv", ["fp8", "f32", "int4"])
def test_export_is_the_engines_bytes(tmp_path, model_dir, kv) -> None:
    store = SessionStore(tmp_path / "store")
    s = store.create("chat", model_dir, kv_dtype=kv)
    s.generate(PROMPT, 10)
    s.generate(PROMPT[:6] + [1, 2], 3)  # a truncate: the session file now has a stale tail
    committed = s.committed
    s.close()
    with open_kv(store.kv_path("chat")) as r:
        assert r.stale_tail_bytes > 0
        expected = pack_header(r.header.with_nrec(committed)) + bytes(r.records_bytes_view(0, committed))
    path = export_slot(store, "chat", model_dir, slot=4)
    assert path == model_dir / ".coli_kv.4"
    assert path.read_bytes() == expected  # header with nrec = committed, the records, nothing more
    assert not os.path.exists(str(path) + ".colisum")
    assert not [p for p in os.listdir(model_dir) if p.endswith(".tmp")]
    with open_kv(path, expect=Dims(*load_model(model_dir).dims_for_file())) as r:
        assert r.nrec == committed and r.stale_tail_bytes == 0
    back = import_slot(store, model_dir, slot=4, session_id="back")
    assert store.history("back") == store.history("chat")[:committed]
    assert back.kv_dtype == kv
    path.unlink()


def test_export_checks_the_model(tmp_path, model_dir) -> None:
    other = write_tiny_checkpoint(tmp_path / "other", seed=77)
    store = SessionStore(tmp_path / "store")
    s = store.create("chat", model_dir, kv_dtype="fp8")
    s.generate(PROMPT, 2)
    s.close()
    with pytest.raises(ModelMismatchError, match="--force"):
        export_slot(store, "chat", other)
    assert not (other / ".coli_kv").exists()
    assert export_slot(store, "chat", other, force=True).exists()  # same dims: allowed on request
    (other / "config.json").write_text(json.dumps({**json.loads((other / "config.json").read_text()),
                                                     "num_hidden_layers": 2}))
    with pytest.raises(ModelMismatchError):
        export_slot(store, "chat", other, force=True)
    with pytest.raises(NotFoundError):
        export_slot(store, "chat", tmp_path / "nowhere")


def test_slot_cli_round_trip(tmp_path, model_dir, capsys) -> None:
    _engine_slot(model_dir, 1, "fp8")
    root = str(tmp_path / "store")
    assert main(["import-slot", str(model_dir), "--slot", "1", "--root", root, "--id", "eng", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["imported"]["id"] == "eng" and out["imported"]["tokens"] == len(PROMPT)
    assert main(["export-slot", "--root", root, "eng", str(model_dir), "--slot", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["tokens"] == len(PROMPT)
    assert (model_dir / ".coli_kv.5").read_bytes() == (model_dir / ".coli_kv.1").read_bytes()
    assert main(["export-slot", "--root", root, "missing", str(model_dir)]) != 0
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    for name in (".coli_kv.1", ".coli_kv.5"):
        (model_dir / name).unlink()
