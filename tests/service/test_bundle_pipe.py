"""The upload pipe between the event loop and the receiving thread (order, backpressure, the end,
errors, abandonment) and the GET's compression choice."""
from __future__ import annotations

import asyncio
import threading

import pytest

from sessionstore.service import is_loopback_address
from sessionstore.service.errors import ApiError
from sessionstore.service.fleet.bundle_export import export_compression
from sessionstore.service.fleet.bundle_upload import BodyPipe, in_thread


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
            most = max(most, pipe.buffered)
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
        return pipe.buffered

    assert asyncio.run(main()) == 0


@pytest.mark.parametrize(("host", "loop"), [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True),
                                            ("::ffff:127.0.0.1", True), ("10.0.0.2", False),
                                            ("2001:db8::1", False), ("localhost", False), (None, False)])
def test_loopback_peers(host: str | None, loop: bool) -> None:
    assert is_loopback_address(host) is loop


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
    from sessionstore.service.fleet.bundle_export import JOIN_BYTES, ChunkHandoff, QueueSink, ReaderGone

    async def main() -> None:
        out = ChunkHandoff(asyncio.get_running_loop(), capacity=8)
        sink = QueueSink(out)
        big = bytes(range(256)) * (JOIN_BYTES // 256)

        async def next_item() -> bytes | BaseException:
            return await asyncio.wait_for(out.get(), 5)

        assert sink.write(b"HEAD" * 6) == 24  # a chunk header waits...
        assert sink.write(memoryview(big)) == len(big)
        assert await next_item() == b"HEAD" * 6 + big  # ...to go out with its payload: one item
        sink.write(b"FEND")
        sink.write(b"TRLR")
        sink.flush()
        assert await next_item() == b"FENDTRLR"
        sink.flush()  # nothing waits: nothing sent
        sink.write(big)
        assert await next_item() == big
        out.close()
        with pytest.raises(ReaderGone):
            sink.write(big)

    asyncio.run(main())


def test_an_export_whose_reader_left_gives_up_and_strands_no_thread() -> None:
    """The exporting thread waits for room while its reader is slow, and gives up once the
    reader closes the handoff (no thread of the loop's executor is involved either way)."""
    from sessionstore.service.fleet.bundle_export import GONE_POLL_S, ChunkHandoff, ReaderGone

    async def main() -> None:
        out = ChunkHandoff(asyncio.get_running_loop(), capacity=2)
        outcome: list[str] = []

        def export() -> None:
            try:
                for _ in range(100):
                    out.put(b"x" * 1000)
                outcome.append("finished")
            except ReaderGone:
                outcome.append("gave up")

        writer = threading.Thread(target=export)
        writer.start()
        assert await asyncio.wait_for(out.get(), 5) == b"x" * 1000
        await asyncio.sleep(0.1)  # the writer waits for room (2 in flight)
        assert writer.is_alive() and outcome == []
        out.close()  # the client left
        for _ in range(100):
            if not writer.is_alive():
                break
            await asyncio.sleep(GONE_POLL_S / 10)
        assert not writer.is_alive() and outcome == ["gave up"]

    asyncio.run(main())


def test_a_download_abandoned_before_or_after_its_first_chunk_closes_its_export(tmp_path, monkeypatch) -> None:
    import gc

    from sessionstore.migration.exporting import PreparedExport
    from sessionstore.service.fleet import bundle_export as bundles
    from sessionstore.sessions import SessionStore
    from sessionstore.sessions.fingerprint import model_fingerprint
    from tests.support.migrate import make_session

    store = SessionStore(tmp_path / "a")
    make_session(store, "mv", 40_000, kv_dtype="f32", fingerprint=model_fingerprint("tiny"), model_name="tiny")
    closed: list[int] = []

    class Counted(PreparedExport):
        def close(self) -> None:
            closed.append(1)
            super().close()

    monkeypatch.setattr(bundles, "PreparedExport", Counted)

    class OneInFlight(bundles.ChunkHandoff):  # ~19 MB is five 4 MiB chunks: more than one waits, always
        def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int = 1) -> None:
            super().__init__(loop, 1)

    monkeypatch.setattr(bundles, "ChunkHandoff", OneInFlight)

    def exporting() -> int:
        return sum(t.name == "coli-export" for t in threading.enumerate())

    async def main() -> None:
        never, _ = await bundles.export_stream(store, "mv", "none")
        del never  # the response failed before its body: no thread started, the export closed
        gc.collect()
        assert closed == [1] and exporting() == 0
        left, headers = await bundles.export_stream(store, "mv", "none")
        first = await left.__anext__()
        assert 0 < len(first) < int(headers["content-length"]) and exporting() == 1
        await left.aclose()  # the client left after one chunk
        for _ in range(100):
            if exporting() == 0:
                break
            await asyncio.sleep(0.05)
        assert exporting() == 0 and closed == [1, 1]

    asyncio.run(main())
