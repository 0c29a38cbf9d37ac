"""In-process pieces of the service: stop strings over streamed text, the bind rule, the limits,
the error mapping, the event loop's outbox."""
from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernels.errors import FormatError, LimitError, LockedError, ModelMismatchError, NotFoundError
from sessionstore.service import ServiceLimits, api_error_of, check_bind, is_loopback_host, parse_bind
from sessionstore.service.fleet.loop_outbox import LoopOutbox
from sessionstore.service.http.streams import Event
from sessionstore.sessions.output import OutputProcessor, StopStrings, TurnStop


class Sink:
    def __init__(self) -> None:
        self.pieces: list[str] = []

    def text(self, piece: str) -> None:
        self.pieces.append(piece)

    def cancelled(self) -> bool:
        return False


def _gate(stops: list[str], pieces: list[str]) -> tuple[StopStrings, Sink]:
    sink = Sink()
    gate = StopStrings(stops, sink.text)
    for p in pieces:
        gate.push(p)
        if gate.hit:
            break
    gate.flush()
    return gate, sink


def test_stop_string_split_over_pieces_is_never_streamed() -> None:
    gate, sink = _gate(["END"], ["hello E", "N", "D tail"])
    assert gate.hit and gate.emitted == "hello " and "".join(sink.pieces) == "hello "
    gate, sink = _gate(["END"], ["an E", "nd"])  # a held possible start that did not complete goes out
    assert not gate.hit and "".join(sink.pieces) == "an End"


@given(st.lists(st.text(alphabet="abXY", max_size=4), max_size=8), st.sampled_from(["XY", "aXa", "Y"]))
def test_gate_output_is_the_text_up_to_the_first_stop(pieces: list[str], stop: str) -> None:
    gate, sink = _gate([stop], pieces)
    full = "".join(pieces)
    want = full[:full.index(stop)] if stop in full else full
    assert "".join(sink.pieces) == gate.emitted == want
    assert gate.hit == (stop in full)


def test_the_output_processor_ends_a_turn_at_eos_a_stop_string_or_an_abort() -> None:
    """One processor's reasons and OpenAI finish reasons: eos (the token kept), abort, length."""
    out = OutputProcessor(eos=frozenset({7}))
    out.on_token(3, 0)
    with pytest.raises(TurnStop) as stop:
        out.on_token(7, 1)
    assert (stop.value.end, out.end, out.end.finish_reason, out.tokens) == ("eos", "eos", "stop", [3, 7])
    asked = iter([False, True])
    out = OutputProcessor(should_abort=lambda: next(asked))
    out.on_token(7, 0)  # no eos ids: sampled on past them
    with pytest.raises(TurnStop):
        out.on_token(8, 1)
    assert (out.end, out.end.finish_reason, out.tokens) == ("abort", "abort", [7, 8])
    out = OutputProcessor()
    out.on_token(1, 0)
    assert (out.end, out.end.finish_reason, out.finish()) == ("length", "length", "")


def test_bind_rule() -> None:
    assert parse_bind("8080") == ("127.0.0.1", 8080)
    assert parse_bind("0.0.0.0:0") == ("0.0.0.0", 0)
    assert parse_bind("[::1]:9") == ("::1", 9)
    for bad in ("x", "1:99999", "host:", ":-1"):
        with pytest.raises(FormatError):
            parse_bind(bad)
    assert is_loopback_host("127.0.0.2") and is_loopback_host("::1") and is_loopback_host("localhost")
    assert is_loopback_host("::ffff:127.0.0.1")  # the one loopback-address rule (is_loopback_address) holds here too
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("10.0.0.1") and not is_loopback_host("example.com")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "key")
    with pytest.raises(FormatError, match="without an API key"):
        check_bind("0.0.0.0", None)


def test_limits_are_checked() -> None:
    assert ServiceLimits().max_tokens >= ServiceLimits().default_max_tokens
    with pytest.raises(ValueError):
        ServiceLimits(max_resident=0)
    with pytest.raises(ValueError):
        ServiceLimits(default_max_tokens=10, max_tokens=5)
    assert ServiceLimits(prefill_step_ratio=0).prefill_step_ratio == 0  # 0: no pacing, the cap alone
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="prefill_step_ratio must be an integer >= 0"):
            ServiceLimits(prefill_step_ratio=bad)  # type: ignore[arg-type]
    assert ServiceLimits(whole_prompt_tokens=0).whole_prompt_tokens == 0  # 0: every prompt paced
    with pytest.raises(ValueError, match="whole_prompt_tokens must be an integer >= 0"):
        ServiceLimits(whole_prompt_tokens=-1)


def test_errors_map_to_statuses() -> None:
    assert api_error_of(NotFoundError("x")).status == 404
    assert api_error_of(ModelMismatchError("x")).status == 409
    assert api_error_of(LockedError("x")).status == 409
    assert api_error_of(LimitError("x")).status == 400
    assert api_error_of(FormatError("x")).status == 400
    body = api_error_of(RuntimeError("boom")).body()
    assert body["error"]["type"] == "server_error" and "boom" in body["error"]["message"]


def test_loop_outbox_keeps_each_queues_order_and_wakes_the_loop_once_per_burst() -> None:
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever)
    runner.start()
    try:
        box = LoopOutbox(loop)
        queues = asyncio.run_coroutine_threadsafe(_queues(3), loop).result(5)
        go = threading.Barrier(3)

        def producer(q: int) -> None:
            go.wait()
            for i in range(200):
                assert box.put(queues[q], Event("text", i))

        threads = [threading.Thread(target=producer, args=(q,)) for q in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = asyncio.run_coroutine_threadsafe(_drain_all(queues, 200), loop).result(5)
        assert got == [list(range(200))] * 3  # every event, in order, per queue
        assert 1 <= box.drains < 600  # bursts shared a wake-up of the loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()
    assert not box.put(queues[0], Event("text", 0))  # the loop is gone: the turn learns nobody listens


async def _queues(n: int) -> list[asyncio.Queue[Event]]:
    return [asyncio.Queue() for _ in range(n)]


async def _drain_all(queues: list[asyncio.Queue[Event]], n: int) -> list[list[int]]:
    return [[(await q.get()).value for _ in range(n)] for q in queues]
