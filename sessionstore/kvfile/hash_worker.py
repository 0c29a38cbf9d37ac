"""The checksum helper's program: run as ``python -I <this file>`` by :mod:`.hash_helper`, it
hashes ranges of records of a file it is told about, one request at a time, until its stdin ends.

It imports the standard library and xxhash only (not this package: a process that imported
numpy, numba and the kernels cost every server start more than a second of CPU and ~150 MB),
and runs isolated (``-I``), so nothing on the path or in the environment changes it. Its parent
dying closes its stdin, which ends it: it never outlives a killed server.

Wire (both directions little-endian): a request is one line of JSON
``{"path", "dev", "ino", "offset", "record_bytes", "start", "stop"}``; each answer is
``<B status><Q length>`` then ``length`` bytes: status 0, the records' xxh3_64 checksums as
``<u8`` (one per record, seeded with its index); status 1, the reason it could not, UTF-8.
Answers come in the order of the requests.
"""
from __future__ import annotations

import json
import mmap
import os
import signal
import struct
import sys
from array import array
from typing import BinaryIO

import xxhash

ANSWER = struct.Struct("<BQ")  # status, payload length
OK, FAILED = 0, 1


def hash_file_records(path: str, identity: tuple[int, int], offset: int, record_bytes: int,
                      start: int, stop: int) -> bytes:
    """The xxh3_64 checksums of records [start, stop) of the file at ``path`` (record r at
    ``offset + r * record_bytes``, seeded with r), as <u8 bytes; refuses a file that is not
    ``identity`` (st_dev, st_ino)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != tuple(identity):
            raise FileNotFoundError(f"{path}: not the file the reader mapped (replaced meanwhile)")
        lo, hi = offset + start * record_bytes, offset + stop * record_bytes
        base = lo - lo % mmap.ALLOCATIONGRANULARITY
        out = array("Q", bytes(8 * (stop - start)))  # [k] u64
        populate = getattr(mmap, "MAP_POPULATE", 0)  # every byte is hashed next: page tables filled at once
        with mmap.mmap(fd, hi - base, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ, offset=base) as mapped:
            view = memoryview(mapped)
            try:
                for i, r in enumerate(range(start, stop)):
                    at = lo - base + i * record_bytes
                    out[i] = xxhash.xxh3_64_intdigest(view[at:at + record_bytes], seed=r)
            finally:
                view.release()
        if sys.byteorder != "little":
            out.byteswap()
        return out.tobytes()
    finally:
        os.close(fd)


def answer(request: bytes) -> tuple[int, bytes]:
    """(status, payload) for one request line."""
    try:
        r = json.loads(request)
        return OK, hash_file_records(r["path"], (r["dev"], r["ino"]), r["offset"], r["record_bytes"],
                                     r["start"], r["stop"])
    except Exception as exc:  # any failure is the caller's to hash instead: said, never fatal
        return FAILED, f"{type(exc).__name__}: {exc}".encode()


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    """Answer every request line of ``requests`` on ``answers`` until ``requests`` ends."""
    for line in requests:
        status, payload = answer(line)
        answers.write(ANSWER.pack(status, len(payload)) + payload)
        answers.flush()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the process group: the parent decides
    try:
        serve(sys.stdin.buffer, sys.stdout.buffer)
    except (BrokenPipeError, KeyboardInterrupt):  # the parent went away: nothing to answer
        pass
