"""A long prompt's checks in the API process take their fast paths (a proof over the raw bytes, C
passes over a list of plain ints) and give what the full checks give: the same value, the same
refusal, whatever the position of the one bad value. In process, no server (~0.2 s)."""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from sessionstore.service.errors import ApiError
from sessionstore.service.http.jsonbody import MAX_INT_DIGITS, read_json_body
from sessionstore.service.http.protocol import CompletionRequest, all_token_ids, is_token_id
from sessionstore.service.limits import ServiceLimits

N = 32768  # a GLM-5.2-shaped session's history, as bench.serve's resume figure sends it


def _ids() -> list[int]:
    return np.random.default_rng(7).integers(0, 154880, N).tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize("bad", [-1, 1 << 31, True, False, 1.0, "7", None, [1]])
@pytest.mark.parametrize("where", [0, N // 2, N - 1])
def test_one_bad_id_anywhere_is_found_as_the_per_value_check_finds_it(bad: Any, where: int) -> None:
    ids: list[Any] = _ids()
    assert all_token_ids(ids) and all(is_token_id(t) for t in ids)
    ids[where] = bad
    assert not all_token_ids(ids)
    assert all_token_ids(ids) == all(is_token_id(t) for t in ids)


def test_the_edges_of_the_id_range_and_the_empty_list() -> None:
    for ids in ([0], [(1 << 31) - 1], [0, (1 << 31) - 1], []):
        assert all_token_ids(ids) == all(is_token_id(t) for t in ids)
    assert all_token_ids([0, (1 << 31) - 1]) and all_token_ids([])


def test_a_long_id_prompt_parses_and_checks_to_the_same_value_and_a_bad_last_id_is_refused() -> None:
    ids, limits = _ids(), ServiceLimits()
    raw = json.dumps({"model": "m", "prompt": ids, "session": "s"}).encode()
    assert read_json_body(raw) == json.loads(raw)
    req = CompletionRequest.model_validate(read_json_body(raw))
    req.check(limits)
    assert req.prompts(limits) == [ids]
    for bad in ("-1", str(1 << 31), "true", "1.5"):
        body = raw[:raw.rindex(b"]")].rsplit(b",", 1)[0] + b", " + bad.encode() + b"]" + raw[raw.rindex(b"]") + 1:]
        req = CompletionRequest.model_validate(read_json_body(body))
        with pytest.raises(ApiError, match="prompt: must be"):
            req.prompts(limits)


def test_the_raw_byte_proofs_fall_back_to_the_full_checks() -> None:
    ids = _ids()
    long_int = "9" * (MAX_INT_DIGITS + 1)
    # a long digit run inside a string: the full parse runs and accepts it
    raw = json.dumps({"prompt": ids, "note": long_int}).encode()
    assert read_json_body(raw) == json.loads(raw)
    # the same run as an integer, after 32k short ones: refused
    with pytest.raises(ApiError, match=f"{MAX_INT_DIGITS + 1} digits"):
        read_json_body(json.dumps({"prompt": ids, "n": 10 ** MAX_INT_DIGITS}).encode())
    # an escaped backslash before "ud800" is no surrogate: accepted, the same value
    raw = json.dumps({"prompt": ids, "s": "\\ud800"}).encode()
    assert read_json_body(raw) == json.loads(raw)
    # a lone surrogate escape (either case of hex) after 32k ids: refused, naming its field
    for esc in (b"\\udfff", b"\\uDC00"):
        with pytest.raises(ApiError) as refused:
            read_json_body(b'{"prompt": ' + json.dumps(ids).encode() + b', "m": ["ok", "' + esc + b'"]}')
        assert refused.value.param == "m.1"
    assert read_json_body(b'{"s": "\\ud83d\\ude00"}') == {"s": "\U0001f600"}  # a pair is text
