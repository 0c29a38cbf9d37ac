"""Helpers for the migration tests: synthetic sessions, store tree snapshots, an S3 server."""
from __future__ import annotations

import logging
import os
import socket
import sqlite3
import struct
from pathlib import Path

import numpy as np
import pytest

from kernels.errors import CorruptionError
from kernels.model.sampling import Sampler
from kernels.rows import RecordRows
from sessionstore.kvfile.header import Dims
from sessionstore.kvfile.reader import open_kv
from sessionstore.kvfile.writer import KVWriter
from sessionstore.sessions.catalogue_schema import CATALOGUE_NAME
from sessionstore.sessions.digest import make_digest
from sessionstore.sessions.directory import STATE_NAME
from sessionstore.sessions.manifest import MANIFEST_NAME, Manifest, ModelRef, write_manifest
from sessionstore.sessions.paths import KV_NAME, SIDECAR_NAME, check_component
from sessionstore.sessions.store import SessionStore
from sessionstore.sessions.tier_record import refuse_offloaded

SMALL_DIMS = Dims(n_layers=3, kv_lora=32, qk_rope=8, index_head_dim=0, n_index_layers=0, vocab=1000)
TEST_FINGERPRINT = "fp1:" + "ab" * 32


def synthetic_rows(n: int, dims: Dims, seed: int, start: int = 0) -> RecordRows:
    """n positions of latent-like f32 rows (per-channel scales, a few outliers)."""
    rng = np.random.default_rng(seed * 7919 + start)
    L = dims.n_layers
    chan = np.exp(rng.standard_normal(dims.kv_lora)).astype(np.float32)  # [kv_lora] f32
    lc = rng.standard_normal((n, L, dims.kv_lora)).astype(np.float32) * chan  # [n, L, kv_lora] f32
    rc = rng.standard_normal((n, L, dims.qk_rope)).astype(np.float32)  # [n, L, rope] f32
    tokens = rng.integers(0, dims.vocab, size=n, dtype=np.int32)  # [n] i32
    return RecordRows(tokens=tokens, lc=lc, rc=rc)


def make_session(store: SessionStore, session_id: str, n: int, *, kv_dtype: str = "fp8",
                 dims: Dims = SMALL_DIMS, seed: int = 0, fingerprint: str = TEST_FINGERPRINT,
                 model_name: str = "test-model") -> Manifest:
    """A complete session of n committed records, installed through ``adopt_dir``."""
    tmp = store.directory.tmp_dir()
    with KVWriter.open(tmp / "kv.coli_kv", dims, kv_dtype=kv_dtype) as writer:
        if n:
            writer.append(synthetic_rows(n, dims, seed))
        writer.commit()
    os.unlink(tmp / "kv.coli_kv.lock")
    logits = np.random.default_rng(seed).standard_normal(dims.vocab).astype(np.float32)  # [vocab]
    manifest = Manifest(id=session_id, model=ModelRef(model_name, model_name, fingerprint),
                        kv_dtype=kv_dtype, dims=dict(zip(
                            ("n_layers", "kv_lora", "qk_rope", "index_head_dim",
                             "n_index_layers", "vocab"), dims.as_tuple(), strict=True)),
                        committed=n, pending=[int(np.argmax(logits))] if n else [],
                        sampler=Sampler(temperature=0.7, top_k=20, top_p=0.9, seed=seed),
                        last_logits=make_digest(logits, n - 1) if n else None)
    write_manifest(tmp / "manifest.json", manifest)
    store.adopt_dir(tmp, session_id)
    return manifest


def files_of(store: SessionStore, session_id: str) -> list[Path]:
    """The session's files to copy it whole: manifest, kv, then the sidecar and the commit state
    page when present; the lock file is not data."""
    d = store.directory.existing_dir(session_id)
    refuse_offloaded(d, session_id)
    files = [d / MANIFEST_NAME, d / KV_NAME]
    files += [d / optional for optional in (SIDECAR_NAME, STATE_NAME) if check_component(d / optional, want="file")]
    for f in files[:2]:
        if not check_component(f, want="file"):
            raise CorruptionError(f"{f}: missing from session {session_id!r}")
    return files


def session_files(store: SessionStore, session_id: str) -> dict[str, bytes]:
    """A session's files by name, each cut to its content: the kv file to its header and
    committed records (a writer may leave a stale tail or preallocated headroom past nrec, which
    the engine ignores), the sidecar to the entries it vouches for (its zero-filled headroom past
    the count is checked zero)."""
    out = {p.name: p.read_bytes() for p in files_of(store, session_id)}
    with open_kv(store.kv_path(session_id)) as reader:
        out["kv.coli_kv"] = out["kv.coli_kv"][:40 + reader.nrec * reader.record_bytes]
    side = out.get("kv.coli_kv.colisum")
    if side is not None and len(side) >= 64:
        count = struct.unpack_from("<Q", side, 32)[0]
        end = 64 + 8 * count
        assert not any(side[end:]), "sidecar bytes past its count must be zero headroom"
        out["kv.coli_kv.colisum"] = side[:end]
    return out


def tree_state(root: Path) -> dict[str, bytes | str]:
    """Every name under ``root`` with its bytes (files) or kind: equal trees, equal dicts. A
    store's session catalogue (FORMAT.md 5.9) stands as its rows: its file, WAL and shared-memory
    bytes change when it is only read."""
    out: dict[str, bytes | str] = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        out[rel + "/"] = "dir"
        for name in filenames:
            path = os.path.join(dirpath, name)
            key = os.path.normpath(os.path.join(rel, name))
            if rel == "." and name in (CATALOGUE_NAME + "-wal", CATALOGUE_NAME + "-shm"):
                continue
            if rel == "." and name == CATALOGUE_NAME and not os.path.islink(path):
                out[key] = catalogue_rows(Path(path))
                continue
            out[key] = "symlink" if os.path.islink(path) else Path(path).read_bytes()
    return out


def catalogue_rows(path: Path) -> str:
    """The rows of a session catalogue's ``sessions`` table, in id order, as text."""
    db = sqlite3.connect(path)
    try:
        return repr(db.execute("SELECT * FROM sessions ORDER BY id").fetchall())
    finally:
        db.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_s3_server():  # moto's ThreadedMotoServer
    """A real S3 API server (moto) on 127.0.0.1; returns (server, endpoint URL)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_SESSION_TOKEN": "testing"}
S3_BUCKET = "fleet"


@pytest.fixture(scope="module")
def s3_endpoint():  # yields the endpoint URL
    """A moto S3 server for the module; the AWS environment points at it (as AWS_ENDPOINT_URL),
    so s3fs in this process and in child processes finds it the standard way."""
    import s3fs

    server, endpoint = start_s3_server()
    saved = {k: os.environ.get(k) for k in (*S3_ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        s3fs.S3FileSystem().mkdir(S3_BUCKET)
    except FileExistsError:  # moto keeps its state per process, across servers
        pass
    try:
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def stored_keys(remote, *parts: str) -> list[str]:  # a RemoteStore
    """The keys of the objects under ``remote``'s prefix / ``parts``, listed flat (no delimiter),
    as the tier lists them. Not s3fs's ``find``/``ls``: SeaweedFS keeps a prefix whose objects were
    all deleted as an empty directory, which those report as an entry (FORMAT.md 6.4, "What
    stores answer")."""
    prefix = remote.objects.key(*parts) + "/"
    keys: list[str] = []
    page: dict = {"IsTruncated": True}
    while page.get("IsTruncated"):
        more = {"ContinuationToken": page["NextContinuationToken"]} if page.get("NextContinuationToken") else {}
        page = remote.objects.call("list_objects_v2", Prefix=prefix, **more)
        keys += [str(obj["Key"]) for obj in page.get("Contents", []) if not str(obj["Key"]).endswith("/")]
    return sorted(keys)
