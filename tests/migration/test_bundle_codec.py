"""The bundle codec on its own: round trips, framing, limits, and hostile streams."""
from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.errors import ColiError, CorruptionError, FormatError, LimitError
from sessionstore.migration import bundle as B
from sessionstore.migration.bundle_compress import PROBE_SAMPLE_BYTES, CompressionPolicy
from sessionstore.migration.bundle_format import (
    BUNDLE_MAGIC,
    CHUNK_HEAD,
    CODEC_RAW,
    CODEC_ZSTD,
    FILE_END,
    MANIFEST_HEAD,
    MAX_FILE_BYTES,
    MIN_CHUNK_BYTES,
    PREAMBLE,
    BundleFile,
    BundleManifest,
    parse_json,
)


def _manifest(files: dict[str, bytes], chunk_bytes: int = MIN_CHUNK_BYTES,
              session_id: str = "s1") -> BundleManifest:
    entries = tuple(BundleFile(name, len(data)) for name, data in files.items())
    return BundleManifest(session_id=session_id, session={"id": session_id},
                            kv={"version": 2}, files=entries, chunk_bytes=chunk_bytes)


def make_bundle(files: dict[str, bytes], *, chunk_bytes: int = MIN_CHUNK_BYTES,
                mode: str | int = "none", piece: int = 3000) -> bytes:
    sink = io.BytesIO()
    writer = B.BundleWriter(sink, _manifest(files, chunk_bytes), CompressionPolicy(mode))
    for name, data in files.items():
        writer.write_file(name, (data[i:i + piece] for i in range(0, len(data), piece)))
    writer.finish()
    return sink.getvalue()


def read_bundle(data: bytes) -> dict[str, bytes]:
    reader = B.BundleReader(io.BytesIO(data), "test.bundle")
    out = {f.name: b"".join(reader.iter_file(f.name)) for f in reader.manifest.files}
    reader.finish()
    return out


def _files(seed: int = 0, kv_size: int = 50_000) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 64, size=kv_size, dtype=np.uint8)  # [n] u8: compressible-ish
    return {"manifest.json": b'{"id": "s1"}', "kv.coli_kv": codes.tobytes(),
            "kv.coli_kv.colisum": rng.bytes(64 + 8 * 10)}


@pytest.mark.parametrize("mode", ["none", 1, 3, "auto"])
@pytest.mark.parametrize("kv_size", [0, 1, MIN_CHUNK_BYTES, 3 * MIN_CHUNK_BYTES + 17])
def test_round_trip_any_size_and_mode(mode, kv_size):
    files = _files(kv_size=kv_size)
    assert read_bundle(make_bundle(files, mode=mode)) == files


def test_fixed_level_compresses_compressible_chunks_and_stores_random_raw():
    files = {"manifest.json": b"{}", "kv.coli_kv": bytes(20_000) + np.random.default_rng(1).bytes(8192)}
    data = make_bundle(files, mode=1, piece=20_000 + 8192)
    reader = B.BundleReader(io.BytesIO(data))
    for f in reader.manifest.files:
        b"".join(reader.iter_file(f.name))
    stats = reader.finish()
    assert stats.zstd_chunks >= 4  # zero chunks shrink
    assert stats.chunks - stats.zstd_chunks >= 2  # random chunks (and tiny manifest) stay raw
    assert len(data) < sum(map(len, files.values()))


def _encode_watching_probes(policy, chunk: bytes, n: int) -> tuple[list[int], list[int]]:
    """(codecs, indices of the chunks that were probes) for n encodes of ``chunk``."""
    codecs, probes = [], []
    for i in range(n):
        measured = policy.measured
        codecs.append(policy.encode(chunk)[0])
        if policy.measured > measured:
            probes.append(i)
    return codecs, probes


def test_auto_policy_stays_raw_when_the_sink_is_faster_than_compression():
    policy = CompressionPolicy("auto", probe_every=8)
    policy.note_sink(1e-12, 1 << 30)  # a sink that costs nothing per byte
    codecs, probes = _encode_watching_probes(policy, bytes(MIN_CHUNK_BYTES), 60)
    assert probes == [0, 16, 48]  # each losing probe doubles the interval
    assert codecs == [CODEC_RAW] * 60  # a probe is a measurement: the chunk still goes raw
    assert policy.saved_fraction > 0.9  # zeros compress: it is the sink's speed that says no


def test_a_probe_compresses_a_sample_not_the_whole_chunk():
    seen = []
    real = CompressionPolicy("auto").compressor.compress
    policy = CompressionPolicy("auto", compressor=type("Spy", (), {
        "compress": staticmethod(lambda data: seen.append(len(data)) or real(data))})())
    policy.note_sink(1e-12, 1 << 30)
    assert policy.encode(bytes(4 << 20))[0] == CODEC_RAW
    assert seen == [PROBE_SAMPLE_BYTES]


def test_auto_policy_compresses_for_a_slow_sink():
    policy = CompressionPolicy("auto", probe_every=8)
    policy.note_sink(1.0, 1 << 20)  # 1 MB/s
    codecs = [policy.encode(bytes(MIN_CHUNK_BYTES))[0] for _ in range(8)]
    assert codecs == [CODEC_ZSTD] * 8


def test_auto_policy_ignores_short_writes_and_probes_until_the_sink_is_measured():
    policy = CompressionPolicy("auto")
    policy.note_sink(1.0, 24)  # a chunk header: call overhead, not bandwidth
    assert policy.sink_bytes == 0 and not policy.pays()
    assert policy.encode(b"{}" * 100)[0] == CODEC_RAW  # tiny: no probe, nothing learnt
    assert policy.compress_s_per_byte == 0.0
    chunk = bytes(MIN_CHUNK_BYTES)
    codecs, probes = _encode_watching_probes(policy, chunk, 3)
    assert probes == [0, 1, 2] and codecs == [CODEC_RAW] * 3  # no verdict without the sink
    policy.note_sink(1e-12, 1 << 30)  # now a fast sink is measured
    codecs, probes = _encode_watching_probes(policy, chunk, 3)
    assert probes == [0] and codecs == [CODEC_RAW] * 3


def test_auto_policy_follows_a_sink_that_slows_down():
    policy = CompressionPolicy("auto", probe_every=4)
    policy.note_sink(1e-12, 1 << 30)
    assert [policy.encode(bytes(8192))[0] for _ in range(3)][1:] == [CODEC_RAW] * 2
    policy.note_sink(100.0, 1 << 20)  # the link became slow
    assert policy.encode(bytes(8192))[0] == CODEC_ZSTD


def test_layout_of_the_first_bytes_matches_the_spec():
    data = make_bundle({"manifest.json": b"{}", "kv.coli_kv": b"abc"})
    magic, version, flags = struct.unpack_from("<8sII", data, 0)
    assert (magic, version, flags) == (b"COLIBNDL", 1, 0)
    tag, length, check = struct.unpack_from("<4sIQ", data, 16)
    doc = data[32:32 + length]
    assert tag == b"MNFT" and check == xxhash.xxh3_64_intdigest(doc)
    assert json.loads(doc)["files"] == [{"name": "manifest.json", "size": 2},
                                        {"name": "kv.coli_kv", "size": 3}]
    at = 32 + length
    framing = [data[:at]]
    tag, index, codec, reserved, raw_len, stored, chk = struct.unpack_from("<4sHBBIIQ", data, at)
    assert (tag, index, codec, reserved, raw_len, stored) == (b"CHNK", 0, 0, 0, 2, 2)
    assert chk == xxhash.xxh3_64_intdigest(b"{}", seed=0)
    assert data[at + 24:at + 26] == b"{}"
    framing.append(data[at:at + 24])
    at += 26
    assert struct.unpack_from("<4sHHQ16s", data, at) == (
        b"FEND", 0, 0, 2, xxhash.xxh3_128(b"{}").digest())  # file 0 ends: size, whole digest
    framing.append(data[at:at + 32])
    at += 32
    tag, index, codec, _, raw_len, stored, chk = struct.unpack_from("<4sHBBIIQ", data, at)
    assert (tag, index, raw_len, stored) == (b"CHNK", 1, 3, 3)
    assert chk == xxhash.xxh3_64_intdigest(b"abc", seed=1)  # seeded with the chunk ordinal
    framing.append(data[at:at + 24])
    at += 24 + 3
    assert struct.unpack_from("<4sHHQ16s", data, at) == (
        b"FEND", 1, 0, 3, xxhash.xxh3_128(b"abc").digest())
    framing.append(data[at:at + 32])
    at += 32
    trailer = struct.unpack_from("<4sIQQ16s8s", data, at)
    assert trailer[:4] == (b"TRLR", 2, 2, 5)
    # the framing digest: preamble, manifest frame, chunk headers and file-end frames
    assert trailer[4] == xxhash.xxh3_128(b"".join(framing)).digest()
    assert trailer[5] == b"COLIBEND"
    assert len(data) == at + 48


def test_every_truncation_is_refused():
    data = make_bundle(_files(kv_size=9000))
    for cut in sorted({0, 1, 15, 16, 31, 40, len(data) // 2, len(data) - 49, len(data) - 1}):
        with pytest.raises(ColiError):
            read_bundle(data[:cut])


def test_every_single_bit_flip_in_framing_is_refused():
    data = bytearray(make_bundle({"manifest.json": b"{}", "kv.coli_kv": bytes(range(200)) * 30}))
    for pos in range(0, len(data), 7):
        for bit in (0, 5):
            mutated = bytearray(data)
            mutated[pos] ^= 1 << bit
            with pytest.raises(ColiError):
                read_bundle(bytes(mutated))


def test_data_after_the_trailer_is_refused():
    data = make_bundle(_files())
    with pytest.raises(FormatError, match="after the trailer"):
        read_bundle(data + b"\0")


def test_unknown_version_and_flags_are_refused():
    data = bytearray(make_bundle(_files()))
    struct.pack_into("<I", data, 8, 2)
    with pytest.raises(FormatError, match="version 2 is not supported"):
        read_bundle(bytes(data))
    data = bytearray(make_bundle(_files()))
    struct.pack_into("<I", data, 12, 1)
    with pytest.raises(FormatError, match="flags"):
        read_bundle(bytes(data))


def _with_manifest(doc: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(doc).encode()
    return (PREAMBLE.pack(BUNDLE_MAGIC, 1, 0)
            + MANIFEST_HEAD.pack(b"MNFT", len(raw), xxhash.xxh3_64_intdigest(raw)) + raw + body)


def _doc(**overrides) -> dict:
    doc = json.loads(_manifest({"manifest.json": b"{}", "kv.coli_kv": b"x"}).to_json())
    doc.update(overrides)
    return doc


@pytest.mark.parametrize("bad_id", ["../x", "a/b", "a\\b", "..", ".hidden", "a\nb", "a\x00b",
                                    "", "x" * 129, "-rf", "..a", 7, None])
def test_hostile_session_ids_are_refused(bad_id):
    with pytest.raises(FormatError, match="session id"):
        B.BundleReader(io.BytesIO(_with_manifest(_doc(session_id=bad_id))))


@pytest.mark.parametrize("name", ["../manifest.json", "kv.coli_kv.lock", "/etc/passwd",
                                  "kv.coli_kv/../x", "evil.py"])
def test_file_names_outside_the_allow_list_are_refused(name):
    doc = _doc()
    doc["files"][1]["name"] = name
    with pytest.raises(FormatError, match="not one of"):
        B.BundleReader(io.BytesIO(_with_manifest(doc)))


@pytest.mark.parametrize("field,value,error", [
    ("chunk_bytes", 1 << 40, LimitError), ("chunk_bytes", 0, FormatError),
    ("chunk_bytes", 1.5, FormatError), ("version", 9, FormatError),
    ("format", "pickle", FormatError), ("files", [], FormatError),
])
def test_manifest_fields_are_validated(field, value, error):
    with pytest.raises(error):
        B.BundleReader(io.BytesIO(_with_manifest(_doc(**{field: value}))))


def test_declared_file_size_beyond_limit_is_refused_before_reading():
    doc = _doc()
    doc["files"][1]["size"] = MAX_FILE_BYTES + 1
    with pytest.raises(LimitError):
        B.BundleReader(io.BytesIO(_with_manifest(doc)))


def test_manifest_length_beyond_limit_is_refused_before_allocation():
    head = PREAMBLE.pack(BUNDLE_MAGIC, 1, 0) + MANIFEST_HEAD.pack(b"MNFT", 0xFFFFFFFF, 0)
    with pytest.raises(LimitError, match="manifest length"):
        B.BundleReader(io.BytesIO(head))


def test_duplicate_keys_nan_and_deep_nesting_are_refused():
    raw = b'{"format": "coli-bundle", "format": "x"}'
    for bad in (raw, b'{"a": NaN}', b"[" * 5000 + b"]" * 5000, b'{"a":' * 40 + b"1" + b"}" * 40,
                b"\xff\xfe"):
        with pytest.raises((FormatError, LimitError)):
            parse_json(bad, "t")


def test_a_zstd_bomb_is_refused_without_inflating_it():
    """A payload whose frame claims (or holds) more than raw_len is refused before inflation."""
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20))  # 64 MiB of zeros
    doc = _doc()
    doc["files"][1]["size"] = MIN_CHUNK_BYTES
    doc["chunk_bytes"] = MIN_CHUNK_BYTES
    chunk = CHUNK_HEAD.pack(b"CHNK", 0, 0, 0, 2, 2, xxhash.xxh3_64_intdigest(b"{}", seed=0))
    chunk += b"{}" + FILE_END.pack(b"FEND", 0, 0, 2, xxhash.xxh3_128(b"{}").digest())
    bomb_head = CHUNK_HEAD.pack(b"CHNK", 1, 1, 0, MIN_CHUNK_BYTES, len(bomb), 0)
    stream = _with_manifest(doc, chunk + bomb_head + bomb)
    reader = B.BundleReader(io.BytesIO(stream))
    list(reader.iter_file("manifest.json"))
    with pytest.raises(CorruptionError, match="declares 67108864 content bytes"):
        list(reader.iter_file("kv.coli_kv"))
    # a frame without a content size is refused the same way
    streaming = zstandard.ZstdCompressor().compressobj()
    no_size = streaming.compress(bytes(1 << 20)) + streaming.flush()
    assert zstandard.frame_content_size(no_size) == -1
    stream = _with_manifest(doc, chunk + CHUNK_HEAD.pack(
        b"CHNK", 1, 1, 0, MIN_CHUNK_BYTES, len(no_size), 0) + no_size)
    reader = B.BundleReader(io.BytesIO(stream))
    list(reader.iter_file("manifest.json"))
    with pytest.raises(CorruptionError, match="declares -1"):
        list(reader.iter_file("kv.coli_kv"))


def test_swapped_chunks_are_refused_by_the_ordinal_seed():
    files = {"manifest.json": b"{}", "kv.coli_kv": b"A" * MIN_CHUNK_BYTES + b"B" * MIN_CHUNK_BYTES}
    data = make_bundle(files, piece=1 << 20)
    first = data.index(b"CHNK", data.index(b"CHNK") + 1)  # kv's first chunk
    size = 24 + MIN_CHUNK_BYTES
    a, b = data[first:first + size], data[first + size:first + 2 * size]
    swapped = data[:first] + b + a + data[first + 2 * size:]
    with pytest.raises(CorruptionError, match="checksum"):
        read_bundle(swapped)


def _kv_chunk_at(data: bytes) -> int:
    return data.index(b"CHNK", data.index(b"CHNK") + 1)  # kv's first chunk header


def test_the_whole_file_digest_catches_what_a_rechecked_chunk_hides():
    """A payload edited with its chunk checksum recomputed (and the framing digest redone)
    still fails: the file-end frame's whole-file xxh3_128 no longer matches."""
    files = {"manifest.json": b"{}", "kv.coli_kv": bytes(range(256)) * 40}
    data = bytearray(make_bundle(files))
    at = _kv_chunk_at(bytes(data))
    raw_len = struct.unpack_from("<I", data, at + 8)[0]
    data[at + 24 + 7] ^= 0x40
    struct.pack_into("<Q", data, at + 16, xxhash.xxh3_64_intdigest(
        bytes(data[at + 24:at + 24 + raw_len]), seed=1))
    with pytest.raises(CorruptionError, match="whole-file xxh3_128"):
        read_bundle(bytes(data))


def test_file_end_frame_fields_are_checked():
    files = {"manifest.json": b"{}", "kv.coli_kv": bytes(range(256)) * 40}
    data = make_bundle(files)
    fend = data.index(b"FEND", _kv_chunk_at(data))
    for offset, value, match in ((0, b"FENX", "tag"), (4, b"\x00\x00", "file 0"),
                                 (8, struct.pack("<Q", 10239), "size 10239"),
                                 (16, bytes(16), "whole-file")):
        mutated = bytearray(data)
        mutated[fend + offset:fend + offset + len(value)] = value
        with pytest.raises(CorruptionError, match=match):
            read_bundle(bytes(mutated))


def test_iter_file_without_copy_yields_views_of_one_reused_buffer():
    files = _files(kv_size=3 * MIN_CHUNK_BYTES + 17)
    reader = B.BundleReader(io.BytesIO(make_bundle(files)))
    list(reader.iter_file("manifest.json"))
    got, buffers = [], set()
    for view in reader.iter_file("kv.coli_kv", copy=False):
        assert isinstance(view, memoryview)
        buffers.add(id(view.obj))
        got.append(bytes(view))
    assert b"".join(got) == files["kv.coli_kv"] and len(buffers) == 1


def test_cut_chunks_is_zero_copy_for_whole_chunks():
    data = bytes(range(256)) * 64  # 16 KiB
    chunks = list(B.cut_chunks([memoryview(data)[:5000], memoryview(data)[5000:]], 4096))
    assert [len(c) for c in chunks] == [4096, 4096, 4096, 4096]
    assert b"".join(chunks) == data
    assert isinstance(chunks[0], memoryview) and isinstance(chunks[1], bytearray)


def test_writer_refuses_a_source_that_changed_under_it():
    files = {"manifest.json": b"{}", "kv.coli_kv": b"x" * 100}
    sink = io.BytesIO()
    writer = B.BundleWriter(sink, _manifest(files), CompressionPolicy("none"))
    writer.write_file("manifest.json", [b"{}"])
    with pytest.raises(CorruptionError, match="streamed 99 bytes.*changed"):
        writer.write_file("kv.coli_kv", [b"x" * 99])
    with pytest.raises(CorruptionError, match="grew"):
        writer.write_file("kv.coli_kv", [b"x" * 101])
    assert b"TRLR" not in sink.getvalue()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_mutated_bundles_raise_only_our_errors(data):
    base = make_bundle(_files(kv_size=6000), mode=data.draw(st.sampled_from(["none", 1])))
    buf = bytearray(base)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        pos = data.draw(st.integers(0, max(len(buf) - 1, 0)))
        if kind == "flip" and buf:
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set" and buf:
            buf[pos] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del buf[pos:]
        elif kind == "insert":
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=32))
        elif buf:
            del buf[pos:pos + data.draw(st.integers(1, 64))]
    if bytes(buf) == base:
        return
    with pytest.raises(ColiError):
        read_bundle(bytes(buf))
