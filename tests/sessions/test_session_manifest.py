"""The manifest (atomic JSON, strict schema), the logits digest and model fingerprints."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from kernels.errors import CorruptionError, FormatError, LimitError, NotFoundError
from kernels.model.sampling import Sampler
from sessionstore.sessions.digest import make_digest
from sessionstore.sessions.fields import MAX_PENDING
from sessionstore.sessions.fingerprint import fingerprint_dir, fingerprint_tiny
from sessionstore.sessions.manifest import Manifest, ModelRef, read_manifest, write_manifest

DIMS = {"n_layers": 2, "kv_lora": 8, "qk_rope": 4, "index_head_dim": 0, "n_index_layers": 0,
        "vocab": 64}


def _manifest(**kw) -> Manifest:
    base = dict(id="s1", model=ModelRef("tiny", "tiny", "fp1:" + "0" * 64), kv_dtype="fp8",
                dims=dict(DIMS), committed=5, pending=[7],
                sampler=Sampler(0.7, 5, 0.9, 42))
    base.update(kw)
    return Manifest(**base)


def test_round_trip_and_atomic_replace(tmp_path) -> None:
    path = tmp_path / "manifest.json"
    logits = np.linspace(-1, 1, 64, dtype=np.float32)
    m = _manifest(last_logits=make_digest(logits, 4))
    write_manifest(path, m)
    back = read_manifest(path)
    assert back == m
    m.committed = 9
    write_manifest(path, m, durable=False)
    assert read_manifest(path).committed == 9
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temp left behind
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1 and data["formats"] == {"manifest": 1, "coli_kv": 2, "sidecar": 1}


@pytest.mark.parametrize("mutate, err", [
    (lambda d: d.update(schema="other"), FormatError),
    (lambda d: d.update(schema_version=99), FormatError),
    (lambda d: d.pop("model"), FormatError),
    (lambda d: d.update(kv_dtype="bf16"), FormatError),
    (lambda d: d.update(committed=-1), FormatError),
    (lambda d: d.update(committed=True), FormatError),
    (lambda d: d.update(pending=[64]), FormatError),
    (lambda d: d.update(pending=[0] * (MAX_PENDING + 1)), LimitError),
    (lambda d: d.update(kv_file="../../etc/passwd"), FormatError),
    (lambda d: d["sampler"].update(temperature="hot"), FormatError),
    (lambda d: d["sampler"].update(temperature=-0.5), FormatError),
    (lambda d: d["sampler"].update(top_p=0.0), FormatError),
    (lambda d: d["sampler"].update(top_p=1.5), FormatError),
    (lambda d: d["sampler"].update(top_k=-1), FormatError),
    (lambda d: d["sampler"].update(seed=-1), FormatError),
    (lambda d: d["sampler"].update(seed=1 << 64), FormatError),
    (lambda d: d.update(last_logits={"position": 1, "top_ids": [99], "top_values": [1.0], "hash": "x"}),
     FormatError),
])
def test_bad_manifests_are_refused(tmp_path, mutate, err) -> None:
    path = tmp_path / "manifest.json"
    data = _manifest().to_json()
    mutate(data)
    path.write_text(json.dumps(data))
    with pytest.raises(err, match="manifest.json"):
        read_manifest(path)


@pytest.mark.parametrize("kw, field", [
    ({"seed": -1}, "seed"), ({"seed": 1 << 64}, "seed"), ({"seed": True}, "seed"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": -1.0}, "temperature"), ({"top_p": float("nan")}, "top_p"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
])
def test_sampler_settings_refuse_bad_values(kw, field) -> None:
    """Bad settings are refused at construction (the sampler's own rule), before any write."""
    with pytest.raises(FormatError, match=field):
        Sampler(**kw)


def test_good_sampler_settings_are_accepted() -> None:
    s = Sampler(temperature=1, top_k=0, top_p=1.0, seed=(1 << 64) - 1)
    assert not s.greedy and Sampler().greedy


def test_garbage_symlink_and_missing(tmp_path) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(b"\xff\xfe not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        read_manifest(path)
    path.write_bytes(b" " * ((1 << 20) + 1))
    with pytest.raises(LimitError):
        read_manifest(path)
    write_manifest(tmp_path / "real.json", _manifest())
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "real.json")
    with pytest.raises(FormatError):
        read_manifest(link)
    with pytest.raises(NotFoundError):
        read_manifest(tmp_path / "absent.json")


def test_digest_exact_tolerant_and_mismatch() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(64).astype(np.float32) * 3  # [vocab] f32
    d = make_digest(logits, 10)
    assert d.check(logits) == (True, "bit-identical")
    nudged = logits + np.float32(1e-6)
    exact, detail = d.check(nudged)
    assert not exact and "within tolerance" in detail
    bad = logits.copy()
    bad[d.top_ids[0]] -= 5.0
    with pytest.raises(CorruptionError, match="position 10"):
        d.check(bad)
    swapped = logits.copy()  # other top-1 while stored values still agree: refused
    other = int(np.argmin(logits))
    swapped[other] = logits.max() + 1.0
    with pytest.raises(CorruptionError, match="top-1"):
        d.check(swapped)


def test_digest_near_tie_accepts_either_winner() -> None:
    logits = np.zeros(16, dtype=np.float32)
    logits[3], logits[9] = 5.0, 5.0 - 1e-5
    d = make_digest(logits, 0)
    flipped = logits.copy()
    flipped[9] = 5.0 + 1e-5
    exact, _ = d.check(flipped)
    assert not exact


def _checkpoint(path, seed: int, config: dict | None = None) -> None:
    path.mkdir()
    rng = np.random.default_rng(seed)
    cfg = config or {"model_type": "deepseek_v3", "hidden_size": 8}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({"a.weight": rng.standard_normal((8, 8)).astype(np.float32),
               "b.weight": rng.standard_normal((4,)).astype(np.float32)}, str(path / "model.safetensors"))


def test_fingerprint_tells_same_shape_checkpoints_apart(tmp_path) -> None:
    _checkpoint(tmp_path / "m1", 1)
    _checkpoint(tmp_path / "m2", 2)
    _checkpoint(tmp_path / "m1b", 1)
    f1, f2, f1b = (fingerprint_dir(tmp_path / n) for n in ("m1", "m2", "m1b"))
    assert f1.startswith("fp1:") and len(f1) == 4 + 64
    assert f1 == f1b and f1 != f2
    # a reformatted config keeps the fingerprint, a changed value does not
    cfg = json.loads((tmp_path / "m1b" / "config.json").read_text())
    (tmp_path / "m1b" / "config.json").write_text(json.dumps(cfg, indent=4))
    assert fingerprint_dir(tmp_path / "m1b") == f1
    cfg["hidden_size"] = 9
    (tmp_path / "m1b" / "config.json").write_text(json.dumps(cfg))
    assert fingerprint_dir(tmp_path / "m1b") != f1


def test_fingerprint_refuses_bad_safetensors(tmp_path) -> None:
    _checkpoint(tmp_path / "m", 1)
    st = tmp_path / "m" / "model.safetensors"
    raw = bytearray(st.read_bytes())
    raw[0:8] = (10**12).to_bytes(8, "little")
    st.write_bytes(bytes(raw))
    with pytest.raises((FormatError, LimitError), match="header length"):
        fingerprint_dir(tmp_path / "m")
    st.write_bytes(b"abc")
    with pytest.raises(FormatError, match="too short"):
        fingerprint_dir(tmp_path / "m")
    os.unlink(st)
    with pytest.raises(FormatError, match="no \\*.safetensors"):
        fingerprint_dir(tmp_path / "m")
    with pytest.raises(NotFoundError):
        fingerprint_dir(tmp_path / "nothing")


def test_fingerprint_tiny_depends_on_config_and_seed() -> None:
    a = fingerprint_tiny({"x": 1}, 0)
    assert a == fingerprint_tiny({"x": 1}, 0)
    assert a != fingerprint_tiny({"x": 1}, 1) and a != fingerprint_tiny({"x": 2}, 0)


def test_fingerprint_is_reused_until_a_file_changes(tmp_path) -> None:
    _checkpoint(tmp_path / "m", 1)
    first = fingerprint_dir(tmp_path / "m")
    st = tmp_path / "m" / "model.safetensors"
    before = st.stat()
    raw = bytearray(st.read_bytes())
    raw[-1] ^= 0xFF  # same size, same inode: a sampled byte (the last of the last tensor) changes
    st.write_bytes(bytes(raw))
    os.utime(st, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the same mtime: nothing tells
    assert fingerprint_dir(tmp_path / "m") == first  # unchanged stat keys: the files are not read again
    os.utime(st, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    second = fingerprint_dir(tmp_path / "m")
    assert second != first  # a newer mtime: read again, and the changed byte is seen
    (tmp_path / "m" / "extra.safetensors").write_bytes(st.read_bytes())  # a new shard
    assert fingerprint_dir(tmp_path / "m") not in (first, second)
