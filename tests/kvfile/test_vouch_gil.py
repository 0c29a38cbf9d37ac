"""A serial checksum pass on a thread (a server's resume on an I/O thread, an export's or a
shipment's check) leaves the GIL to the process's other threads: a probe thread's ``os.stat`` keeps
its microseconds while another thread checks every record of a large file. Before, the pass hashed
each chunk of records with the GIL held (xxhash keeps it for a record-sized input), and the probe
waited milliseconds for each chunk."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from kernels.rows import RecordRows
from sessionstore.kvfile import KVWriter, open_kv, record_checksum, record_checksums, require_vouched
from sessionstore.kvfile.header import Dims
from tests.support.gil_probe import probe_while

BIG_DIMS = Dims(n_layers=8, kv_lora=2048, qk_rope=64, vocab=1000)  # 16.9 KB fp8 records
RECORDS = 4096  # 69 MB: one chunk of the pass (CHECK_CHUNK_RECORDS)


def big_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(7)
    k, L = RECORDS, BIG_DIMS.n_layers
    rows = RecordRows(
        tokens=rng.integers(0, BIG_DIMS.vocab, k).astype(np.int32),  # [k] i32
        lc_codes=rng.integers(0, 0x7F, (k, L, BIG_DIMS.kv_lora), dtype=np.uint8),  # [k, L, 2048] u8
        lc_scale=(rng.random((k, L)) + 0.01).astype(np.float32),  # [k, L] f32
        rc_codes=rng.integers(0, 0x7F, (k, L, BIG_DIMS.qk_rope), dtype=np.uint8),  # [k, L, 64] u8
        rc_scale=(rng.random((k, L)) + 0.01).astype(np.float32))  # [k, L] f32
    path = tmp_path / "big.coli_kv"
    with KVWriter.open(path, BIG_DIMS, kv_dtype="fp8", create=True) as writer:
        writer.append(rows)
        writer.commit()
    return path


def test_a_serial_check_on_a_thread_leaves_the_gil(tmp_path: Path) -> None:
    path = big_file(tmp_path)
    with open_kv(path) as reader:
        assert require_vouched(reader, RECORDS).checked == RECORDS  # warm: compiled, pages cached
        errors: list[BaseException] = []

        def check_repeatedly() -> None:
            try:
                for _ in range(8):  # ~0.55 GB hashed
                    require_vouched(reader, RECORDS)
            except BaseException as exc:  # handed to the test's thread
                errors.append(exc)

        late = probe_while(threading.Thread(target=check_repeatedly))
    assert not errors, errors
    # with the GIL held per chunk (69 MB, ~5 ms) each wake-up waits for the rest of a chunk: a dozen
    # wake-ups, each ms late; released, dozens, each late by the scheduler's microseconds
    assert len(late) > 20 and float(np.median(late)) < 1e-3, (
        f"{len(late)} wake-ups beside the check, median {np.median(late) * 1e3:.2f} ms late, "
        f"the latest {max(late) * 1e3:.1f} ms")


def test_checksums_of_many_records_equal_one_at_a_time(tmp_path: Path) -> None:
    """The compiled path (a large range) and the binding's (a small one) give the sidecar's entries."""
    path = big_file(tmp_path)
    with open_kv(path) as reader:
        rec = reader.record_bytes
        big = record_checksums(reader.records_bytes_view(0, RECORDS), rec, 0)  # [RECORDS] u64
        small = record_checksums(reader.records_bytes_view(5, 7), rec, 5)  # [2] u64, under the threshold
        view = reader.records_bytes_view(0, RECORDS)
        want = [record_checksum(view[p * rec:(p + 1) * rec], p) for p in range(RECORDS)]
    assert big.tolist() == want and small.tolist() == want[5:7]


def test_a_process_without_compiled_code_hashes_with_the_binding() -> None:
    """A server's API process computes nothing and loads no compiled code: once it says so
    (``hash_without_compiled_code``), a large range's checksums (a bundle export's check) come from
    the xxhash binding, the same values, and numba is never imported."""
    code = ("import sys; from sessionstore.kvfile import hash_without_compiled_code, record_checksum, "
            "record_checksums; hash_without_compiled_code(); buf = bytes(range(256)) * 4096; "
            "got = record_checksums(buf, 4096, 3).tolist(); "
            "want = [record_checksum(buf[i * 4096:(i + 1) * 4096], 3 + i) for i in range(256)]; "
            "print(got == want, 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr
