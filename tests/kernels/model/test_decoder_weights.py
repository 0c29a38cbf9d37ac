"""The hand-written safetensors parser: values, zero copy, hostile headers, sharded directories."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from kernels.errors import FormatError, LimitError, NotFoundError, UnsupportedModelError
from kernels.model import load_model
from kernels.model.config import parse_config
from kernels.model.tiny import tiny_config_dict, tiny_weights
from kernels.model.weights import SafetensorsFile, open_checkpoint


def st_bytes(tensors: dict[str, np.ndarray], *, dtype_tag: str = "F32", header: dict | None = None,
             pad_to: int = 8) -> bytes:
    """A safetensors file written by hand (F32 as is, BF16 by truncating f32 bits, F16 via numpy)."""
    entries, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        a = np.ascontiguousarray(arr, dtype=np.float32)
        if dtype_tag == "F32":
            raw = a.astype("<f4").tobytes()
        elif dtype_tag == "BF16":
            raw = (a.view("<u4") >> 16).astype("<u2").tobytes()
        else:
            raw = a.astype("<f2").tobytes()
        entries[name] = {"dtype": dtype_tag, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header if header is not None else {"__metadata__": {"format": "pt"}, **entries}).encode()
    head += b" " * (-len(head) % pad_to)
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("pad_to", [8, 1])  # 1: the data buffer may start unaligned
def test_f32_is_zero_copy_and_exact(tmp_path: Path, pad_to: int) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    f = SafetensorsFile(write(tmp_path / "a.safetensors", st_bytes({"a": a, "b": a[:1] * 2}, pad_to=pad_to)))
    got = f.read("a")
    assert np.array_equal(got, a) and got.dtype == np.float32
    assert not got.flags.writeable and not got.flags.owndata  # a view of the read-only mapping
    assert np.array_equal(f.read("b"), a[:1] * 2)


@pytest.mark.parametrize("tag", ["BF16", "F16"])
def test_half_precision_converted_to_f32(tmp_path: Path, tag: str) -> None:
    a = np.array([[1.0, -2.5, 0.15625, 3.0e-3], [65504.0 if tag == "F16" else 1e30, -0.0, 7.0, 0.5]], np.float32)
    f = SafetensorsFile(write(tmp_path / "h.safetensors", st_bytes({"h": a}, dtype_tag=tag)))
    got = f.read("h")
    if tag == "BF16":
        expect = (a.view("<u4") & np.uint32(0xFFFF0000)).view("<f4")  # bf16 = the top 16 bits
    else:
        expect = a.astype(np.float16).astype(np.float32)
    assert got.dtype == np.float32 and np.array_equal(got, expect)


def entry(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize(
    "header, data_len, err, text",
    [
        ({"t": entry(offsets=(0, 16))}, 8, FormatError, "outside the data buffer"),
        ({"t": entry(offsets=(8, 16))}, 8, FormatError, "outside the data buffer"),
        ({"t": entry(offsets=(-1, 7))}, 8, FormatError, "outside the data buffer"),
        ({"t": entry(dtype="Q7")}, 8, FormatError, "unknown dtype 'Q7'"),
        ({"t": entry(shape=(3,))}, 8, FormatError, "needs 12 bytes"),
        ({"t": entry(shape=(-2,))}, 8, FormatError, "shape"),
        ({"t": entry(shape=(True, 2))}, 8, FormatError, "shape"),
        ({"t": entry(shape=[1] * 9)}, 8, FormatError, "shape"),
        ({"t": entry(offsets=(0,))}, 8, FormatError, "data_offsets"),
        ({"t": entry(offsets=("0", "8"))}, 8, FormatError, "data_offsets"),
        ({"t": entry(), "u": entry(offsets=(4, 12))}, 12, FormatError, "overlap"),
        ({"t": "nope"}, 8, FormatError, "entry must be an object"),
        ({"__metadata__": [1]}, 0, FormatError, "__metadata__"),
    ],
)
def test_hostile_headers(tmp_path: Path, header: dict, data_len: int, err: type, text: str) -> None:
    path = write(tmp_path / "bad.safetensors", st_bytes({}, header=header) + b"\0" * data_len)
    with pytest.raises(err, match=text) as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value)


def test_header_length_bounded_before_reading(tmp_path: Path) -> None:
    path = write(tmp_path / "huge.safetensors", struct.pack("<Q", 1 << 62) + b"{}")
    with pytest.raises(LimitError, match="exceeds the limit"):
        SafetensorsFile(path)
    path = write(tmp_path / "long.safetensors", struct.pack("<Q", 4096) + b"{}")
    with pytest.raises(FormatError, match="runs past the end of the file"):
        SafetensorsFile(path)
    with pytest.raises(FormatError, match="too short"):
        SafetensorsFile(write(tmp_path / "tiny.safetensors", b"\1\0\0"))


@pytest.mark.parametrize("head", [b"\xff\xfe{}", b"{nope", b"[1, 2]"])
def test_header_not_a_json_object(tmp_path: Path, head: bytes) -> None:
    path = write(tmp_path / "j.safetensors", struct.pack("<Q", len(head)) + head)
    with pytest.raises(FormatError, match="offset 8"):
        SafetensorsFile(path)


def test_known_but_unsupported_dtype_refused_on_read(tmp_path: Path) -> None:
    header = {"q": entry(dtype="F8_E4M3", shape=(8,), offsets=(0, 8))}
    f = SafetensorsFile(write(tmp_path / "q.safetensors", st_bytes({}, header=header) + b"\0" * 8))
    with pytest.raises(UnsupportedModelError, match="F8_E4M3"):
        f.read("q")


def test_not_a_regular_file(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="not a regular file"):
        SafetensorsFile(tmp_path)
    with pytest.raises(NotFoundError):
        SafetensorsFile(tmp_path / "absent.safetensors")


# ---- checkpoint directories -----------------------------------------------------------------

def tiny_dir(tmp_path: Path, *, dtype_tag: str = "F32", shards: int = 1, extra: dict | None = None) -> Path:
    """The tiny model written as a checkpoint directory (optionally sharded with an index)."""
    cfg = parse_config(tiny_config_dict())
    tensors = {**tiny_weights(cfg), **(extra or {})}
    names = sorted(tensors)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict()))
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write(tmp_path / fname, st_bytes({n: tensors[n] for n in group}, dtype_tag=dtype_tag))
        weight_map.update({n: fname for n in group})
    if shards > 1:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


def logits_of(model, tokens=(72, 101, 108, 108, 111)) -> np.ndarray:
    return model.forward(np.array(tokens), model.new_cache("f32"))


def test_checkpoint_dir_matches_embedded_tiny(tmp_path: Path) -> None:
    mtp = {"model.layers.3.self_attn.kv_b_proj.weight": np.ones((7, 3), np.float32)}  # MTP layer: ignored
    model = load_model(tiny_dir(tmp_path, extra=mtp))
    assert model.source == str(tmp_path)
    assert np.array_equal(logits_of(model), logits_of(load_model("tiny")))


def test_sharded_bf16_checkpoint(tmp_path: Path) -> None:
    model = load_model(tiny_dir(tmp_path, dtype_tag="BF16", shards=3))
    ref = logits_of(load_model("tiny"))
    got = logits_of(model)
    assert not np.array_equal(got, ref)  # bf16 rounding of the weights is visible ...
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))  # ... but the model is the same


def test_index_refuses_paths_outside_the_directory(tmp_path: Path) -> None:
    d = tiny_dir(tmp_path, shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../evil.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match="plain"):
        open_checkpoint(d)


def test_index_must_agree_with_shards(tmp_path: Path) -> None:
    d = tiny_dir(tmp_path, shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match="is not in shard"):
        open_checkpoint(d)


def test_duplicate_tensor_across_files_refused(tmp_path: Path) -> None:
    d = tiny_dir(tmp_path)
    write(d / "extra.safetensors", st_bytes({"model.norm.weight": np.ones(64, np.float32)}))
    with pytest.raises(FormatError, match="in both"):
        open_checkpoint(d)


def test_wrong_shape_and_missing_tensor_named(tmp_path: Path) -> None:
    d = tiny_dir(tmp_path)
    write(d / "model.safetensors", st_bytes({**tiny_weights(parse_config(tiny_config_dict())),
                                             "model.norm.weight": np.ones(63, np.float32)}))
    with pytest.raises(FormatError, match=r"'model.norm.weight' has shape \[63\], expected \[64\]"):
        load_model(d)
    weights = tiny_weights(parse_config(tiny_config_dict()))
    del weights["model.layers.1.mlp.gate.e_score_correction_bias"]
    write(d / "model.safetensors", st_bytes(weights))
    with pytest.raises(FormatError, match="missing tensor 'model.layers.1.mlp.gate.e_score_correction_bias'"):
        load_model(d)


def test_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict()))
    with pytest.raises(FormatError, match="no \\*.safetensors"):
        load_model(tmp_path)
