"""The messages between the API process and the engine core (FORMAT.md 7.4), and their framing.

Requests are data: the API process sends :class:`TurnCall`, :class:`Call`, :class:`Cancel` and
:class:`Drain` over one ZeroMQ PUSH socket; the core sends back batches of :class:`Piece`,
:class:`TurnDone`, :class:`Result` and :class:`Failed` over another, each zmq message one msgpack
list (a batched step's pieces for every stream travel as one message). Both sockets are bound by
the API process on ``ipc://`` paths in a private directory (mode 0700) and connected by the core,
so a restarted core reconnects to the same paths. The core's start (:class:`Ready` or
:class:`StartFailed`) is one JSON line on its stdout, read before any zmq traffic.

Why pyzmq + msgspec: zmq gives message framing, queueing while a peer is away and an asyncio
socket for the API's event loop without threads; msgspec encodes typed structs (and the
dataclasses of a turn) to msgpack an order of magnitude faster than json + dict building, and
refuses a message of the wrong shape at decode time.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from kernels.model.logits import TokenLogprob
from sessionstore.service.wire.turn_spec import TurnOutcome, TurnSpec

DEFAULT_SWEEP_INTERVAL_S = 30.0  # CoreConfig.sweep_interval unless the command line names one


class CoreConfig(msgspec.Struct, frozen=True):
    """What the core needs to start: the store, the model, the limits and the fleet's settings,
    and where the API process listens (``requests``: the core pulls; ``events``: it pushes)."""

    root: str
    model: str
    kv_dtype: str
    limits: dict[str, int]
    commit_every: int | None
    durable_stream: bool
    max_kv_bytes: int | None
    remote: str | None
    host_id: str | None
    lease_ttl: float | None
    advertise_url: str | None
    max_disk_bytes: int | None
    ship_every_commit: bool
    sweep_interval: float
    requests: str
    events: str
    parent_pid: int


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """The core is up: the model it serves and the facts the API checks requests against."""

    model: str
    vocab_size: int
    context: int
    pid: int
    remote: str | None = None
    host_id: str | None = None


class StartFailed(msgspec.Struct, frozen=True, tag="start_failed"):
    """The core could not start (a bad model, a store it cannot open): one line for the user."""

    message: str


# ---- API process -> core ------------------------------------------------------------------------
class ResponseJob(msgspec.Struct, frozen=True):
    """A stored Responses turn: the record to write once the turn ends (a
    :class:`~sessionstore.service.wire.response_records.ResponseRecord` as a dict), the chain's messages,
    and the record it continues (None: a new chain). ``conversation``: the conversation (session) the
    turn continues, whose items come before ``chain`` (FORMAT.md 7.5); ``store`` False: no record is
    kept (a conversation's turn only)."""

    record: dict[str, Any]
    chain: list[dict[str, Any]]
    previous: dict[str, Any] | None = None
    conversation: str | None = None
    store: bool = True


class TurnCall(msgspec.Struct, frozen=True, tag="turn"):
    """Run one turn; its pieces, then a :class:`TurnDone` or :class:`Failed`, come back under ``rid``."""

    rid: int
    spec: TurnSpec
    response: ResponseJob | None = None


class Call(msgspec.Struct, frozen=True, tag="call"):
    """One named operation of the core (:data:`sessionstore.service.engine.operations.OPERATIONS`); its
    :class:`Result` or :class:`Failed` comes back under ``rid``."""

    rid: int
    op: str
    args: dict[str, Any] = {}


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    """The client of turn ``rid`` went away: end it at its next token (it commits)."""

    rid: int


class Drain(msgspec.Struct, frozen=True, tag="drain"):
    """The server stops: refuse new work, end running turns at their next token. ``shutdown``:
    then commit and suspend every session and exit 0."""

    shutdown: bool = False


ToCore = TurnCall | Call | Cancel | Drain


# ---- core -> API process ------------------------------------------------------------------------
class Piece(msgspec.Struct, frozen=True, tag="piece"):
    """Text of turn ``rid`` (with the log-probabilities of the tokens drawn since its last piece)."""

    rid: int
    text: str
    logprobs: list[TokenLogprob] | None = None


class TurnDone(msgspec.Struct, frozen=True, tag="done"):
    rid: int
    outcome: TurnOutcome


class Result(msgspec.Struct, frozen=True, tag="result"):
    rid: int
    value: Any = None


class ErrorInfo(msgspec.Struct, frozen=True):
    """An API error as it crosses the boundary: OpenAI's fields, and the holder's URL of a session
    another host holds (the API answers 307 to it)."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None
    holder_url: str | None = None
    held: bool = False


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    rid: int
    error: ErrorInfo


FromCore = Piece | TurnDone | Result | Failed

_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(list[FromCore])
_encoder = msgspec.msgpack.Encoder()


def encode_message(message: ToCore | list[FromCore]) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> list[FromCore]:
    return _from_core.decode(data)


def socket_paths() -> tuple[Path, str, str]:
    """A private directory (0700) and the ``ipc://`` addresses of the two sockets inside it."""
    where = Path(tempfile.mkdtemp(prefix="coli-core-"))
    os.chmod(where, 0o700)
    return where, f"ipc://{where / 'requests'}", f"ipc://{where / 'events'}"


__all__ = ["Call", "Cancel", "CoreConfig", "DEFAULT_SWEEP_INTERVAL_S", "Drain", "ErrorInfo", "Failed", "FromCore",
           "Piece", "Ready", "ResponseJob", "Result", "StartFailed", "ToCore", "TurnCall", "TurnDone",
           "decode_from_core", "decode_to_core", "encode_message", "socket_paths"]
