"""The upload pipe between the event loop and the receiving thread (order, backpressure, the end,
errors, abandonment) and the GET's compression choice."""
from __future__ import annotations

import asyncio
import threading

import pytest

from sessionstore.service.bundle_upload import BodyPipe, in_thread
from sessionstore.service.bundles import export_compression, is_loopback
from sessionstore.service.errors import ApiError


def read_all(pipe: BodyPipe, size: int) -> bytes:
    out = bytearray()
    buf = bytearray(size)
    while True:
        n = pipe.readinto(buf)
        if not n:
            return bytes(out)
        out += buf[:n]


def test_the_pipe_hands_over_every_byte_in_order_under_backpressure() -> None:
    pieces = [bytes([i % 251]) * (1000 + 37 * i) for i in range(200)]

    async def main() -> tuple[bytes, int]:
        pipe = BodyPipe(asyncio.get_running_loop(), high_water=4096)
        gate = threading.Event()
        most = 0

        def reader() -> bytes:
            gate.wait()  # the feeder runs into the high-water mark first
            return read_all(pipe, 3000)

        got = in_thread(reader)
        asyncio.get_running_loop().call_later(0.05, gate.set)
        for piece in pieces:
            await pipe.feed(piece)
            most = max(most, pipe._buffered)
        pipe.end()
        return await got, most

    data, most = asyncio.run(main())
    assert data == b"".join(pieces)
    assert most < 4096 + max(map(len, pieces))  # never more than one piece above the mark


def test_the_pipe_raises_its_error_after_the_bytes_before_it() -> None:
    async def main() -> tuple[bytes, BaseException]:
        pipe = BodyPipe(asyncio.get_running_loop())
        await pipe.feed(b"abc")
        pipe.end(ValueError("cut"))
        buf = bytearray(10)
        first = pipe.readinto(buf)
        with pytest.raises(ValueError) as info:
            pipe.readinto(buf)
        return bytes(buf[:first]), info.value

    data, error = asyncio.run(main())
    assert data == b"abc" and str(error) == "cut"


def test_an_abandoned_pipe_drops_what_is_fed_and_wakes_a_waiting_feeder() -> None:
    async def main() -> int:
        pipe = BodyPipe(asyncio.get_running_loop(), high_water=10)
        await pipe.feed(b"x" * 20)  # at the mark: the next feed waits
        waiting = asyncio.ensure_future(pipe.feed(b"y"))
        await asyncio.sleep(0)
        assert not waiting.done()
        await in_thread(pipe.abandon)
        await asyncio.wait_for(waiting, 5)
        await pipe.feed(b"z" * 100)
        return pipe._buffered

    assert asyncio.run(main()) == 0


@pytest.mark.parametrize(("host", "loop"), [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True),
                                            ("::ffff:127.0.0.1", True), ("10.0.0.2", False),
                                            ("2001:db8::1", False), ("localhost", False), (None, False)])
def test_loopback_peers(host: str | None, loop: bool) -> None:
    assert is_loopback(host) is loop


def test_the_download_compression_choice() -> None:
    assert export_compression(None, "127.0.0.1") == "none"
    assert export_compression(None, "192.168.1.5") == "auto"
    assert export_compression("auto", "127.0.0.1") == "auto"
    assert export_compression("none", "10.1.1.1") == "none"
    assert export_compression("3", "10.1.1.1") == 3
    for bad in ("0", "23", "zstd", "-1", ""):
        with pytest.raises(ApiError) as info:
            export_compression(bad, "127.0.0.1")
        assert info.value.status == 400 and info.value.param == "compress"


def test_the_export_sink_joins_small_writes_to_the_next_large_one() -> None:
    import queue

    from sessionstore.service.bundles import JOIN_BYTES, QueueSink, _Gone

    out: queue.Queue[bytes | BaseException] = queue.Queue(maxsize=8)
    gone = threading.Event()
    sink = QueueSink(out, gone)
    big = bytes(range(256)) * (JOIN_BYTES // 256)
    assert sink.write(b"HEAD" * 6) == 24 and out.empty()  # a chunk header waits
    assert sink.write(memoryview(big)) == len(big)
    assert out.get_nowait() == b"HEAD" * 6 + big  # header and payload: one item
    sink.write(b"FEND")
    sink.write(b"TRLR")
    assert out.empty()
    sink.flush()
    assert out.get_nowait() == b"FENDTRLR" and out.empty()
    sink.flush()
    assert out.empty()  # nothing waits: nothing sent
    gone.set()
    with pytest.raises(_Gone):
        sink.write(big)
