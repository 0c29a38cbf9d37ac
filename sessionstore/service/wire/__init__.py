"""The wire room: what both processes of ``coli-kv serve --http`` speak, apart from the engine core
(as vLLM's V1 keeps its engine's request structs apart from its core).

- ``turn_spec`` (:class:`TurnSpec`: what a request asks of one turn; :class:`TurnOutcome`: what it
  came to), ``ipc`` (the messages between the API process and the core, FORMAT.md 7.4, and their
  framing; the core's start-up :class:`CoreConfig`), ``prompts`` (the template renderer and
  tokenizer: the API process renders, the core re-renders a conversation's history);
- ``response_records`` (a stored response, FORMAT.md 7.6, and the store root's responses
  directory, which the API process reads and writes), ``conversation_ids`` (a conversation's id,
  checked where a request names it) and ``listing`` (``GET /v1/sessions`` paging: the query and
  OpenAI's list object).

The API process (``http``) imports this room and never the engine core's; the core imports it too.
It sits above the floor, ``steps`` and ``fleet`` (it imports none of them but the floor) and below
``engine``; its modules import msgspec (the ``service`` extra), so this surface does too.
"""
from sessionstore.service.wire.conversation_ids import conversation_not_found, is_session_id, new_conversation_id
from sessionstore.service.wire.ipc import (
    DEFAULT_SWEEP_INTERVAL_S,
    Call,
    Cancel,
    CoreConfig,
    Drain,
    ErrorInfo,
    Failed,
    FromCore,
    Piece,
    Ready,
    ResponseJob,
    Result,
    StartFailed,
    ToCore,
    TurnCall,
    TurnDone,
    decode_from_core,
    decode_to_core,
    encode_message,
    socket_paths,
)
from sessionstore.service.wire.listing import PageQuery, in_window, list_object, page_query, problem_description
from sessionstore.service.wire.prompts import PromptRenderer, load_tokenizer
from sessionstore.service.wire.response_records import (
    CONVERSATION_SCHEMA,
    MAX_RECORD_BYTES,
    RESPONSES_DIR,
    ResponseRecord,
    ResponseRecords,
    chain_session_id,
    finish_record,
    is_chain_session,
    is_response_id,
    new_response_id,
    parse_record,
)
from sessionstore.service.wire.turn_spec import TurnOutcome, TurnSpec

__all__ = ["CONVERSATION_SCHEMA", "Call", "Cancel", "CoreConfig", "DEFAULT_SWEEP_INTERVAL_S", "Drain", "ErrorInfo",
           "Failed", "FromCore", "MAX_RECORD_BYTES", "PageQuery", "Piece", "PromptRenderer", "RESPONSES_DIR", "Ready",
           "ResponseJob", "ResponseRecord", "ResponseRecords", "Result", "StartFailed", "ToCore", "TurnCall",
           "TurnDone", "TurnOutcome", "TurnSpec", "chain_session_id", "conversation_not_found", "decode_from_core",
           "decode_to_core", "encode_message", "finish_record", "in_window", "is_chain_session", "is_response_id",
           "is_session_id", "list_object", "load_tokenizer", "new_conversation_id", "new_response_id", "page_query",
           "parse_record", "problem_description", "socket_paths"]
