"""``GET /v1/sessions`` pages from the catalogue over a real server: OpenAI's list shape, every
session exactly once in both orders, bad ``limit``/``after``/``order`` a 400 in OpenAI's error
shape, and a session whose files are gone listed as missing and never served."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from sessionstore.sessions import SessionStore
from tests.service.serverkit import ServerProc

N_FORKS = 11


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, text_model_dir: Path) -> Any:
    root = tmp_path_factory.mktemp("catalogue") / "root"
    store = SessionStore(root)
    s = store.create("base", "tiny")
    s.generate(list(b"page"), 2)
    s.close()
    for i in range(N_FORKS):
        store.fork("base", f"s{i:02d}")
    with ServerProc(root, text_model_dir) as proc:
        proc.model_id = proc.get("/v1/models").json()["data"][0]["id"]
        proc.store = store
        yield proc


def _all_pages(server: ServerProc, limit: int, order: str) -> tuple[list[str], int]:
    ids: list[str] = []
    after: str | None = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": limit, "order": order, **({"after": after} if after else {})}
        body = server.get("/v1/sessions", params=params).json()
        pages += 1
        assert set(body) == {"object", "data", "first_id", "last_id", "has_more"} and body["object"] == "list"
        assert len(body["data"]) <= limit
        if body["data"]:
            assert (body["first_id"], body["last_id"]) == (body["data"][0]["id"], body["data"][-1]["id"])
        ids += [d["id"] for d in body["data"]]
        if not body["has_more"]:
            return ids, pages
        after = body["last_id"]


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_paging_covers_every_session_exactly_once(server: ServerProc, order: str) -> None:
    expected = sorted(["base", *(f"s{i:02d}" for i in range(N_FORKS))], reverse=order == "desc")
    ids, pages = _all_pages(server, 5, order)
    assert ids == expected and pages == 3
    whole = server.get("/v1/sessions", params={"order": order}).json()  # the default page holds them all
    assert [d["id"] for d in whole["data"]] == expected and not whole["has_more"]
    entry = whole["data"][0]
    assert {"id", "object", "tokens", "committed", "bytes", "kv_dtype", "model", "state", "last_use"} <= set(entry)
    assert entry["object"] == "session" and entry["state"] == "suspended" and entry["model"] == "tiny"


@pytest.mark.parametrize(("params", "param"), [
    ({"limit": "0"}, "limit"), ({"limit": "1001"}, "limit"), ({"limit": "ten"}, "limit"),
    ({"limit": "-3"}, "limit"), ({"limit": "9" * 40}, "limit"), ({"after": "../etc"}, "after"),
    ({"after": "x" * 200}, "after"), ({"order": "random"}, "order"), ({"order": ""}, "order"),
])
def test_bad_page_parameters_are_400_in_openais_error_shape(server: ServerProc, params: dict[str, str],
                                                            param: str) -> None:
    response = server.get("/v1/sessions", params=params)
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == "invalid_value" and err["type"] == "invalid_request_error"
    assert param in err["message"]


def test_a_session_whose_files_are_gone_is_listed_missing_and_never_served(server: ServerProc) -> None:
    shutil.rmtree(server.store.session_dir("s10"))
    listed = {d["id"]: d for d in server.get("/v1/sessions", params={"after": "s09"}).json()["data"]}
    assert listed["s10"]["state"] == "missing" and listed["s10"]["error"]["code"] == "session_files_missing"
    assert server.get("/v1/sessions/s10").status_code == 404
    turn = server.post("/v1/completions", json={"model": server.model_id, "prompt": [5, 6], "max_tokens": 2,
                                                "session": "s10"})
    assert turn.status_code == 404, turn.text
    assert "files are gone" in turn.json()["error"]["message"]
    assert not server.store.session_dir("s10").exists()  # not made anew under the lost id
    assert httpx.get(server.url + "/healthz", timeout=10).status_code == 200


def test_fleet_windows_of_consecutive_pages_cover_every_id_once() -> None:
    """A fleet server's page keeps the fleet's sessions in its id window: consecutive windows
    (cursor, last id] partition the ids, in both orders, so no fleet session is listed twice or
    skipped, whatever the local pages hold."""
    from sessionstore.service.wire.listing import PageQuery, in_window

    fleet_ids = [f"r{i:02d}" for i in range(9)] + ["a", "m", "zz"]
    local = ["b", "d", "n", "r04", "y"]
    for order in ("asc", "desc"):
        local_sorted = sorted(local, reverse=order == "desc")
        seen: list[str] = []
        after = None
        for start in range(0, len(local_sorted), 2):
            chunk = local_sorted[start:start + 2]
            has_more = start + 2 < len(local_sorted)
            query = PageQuery(2, after, order)
            seen += [i for i in sorted(set(fleet_ids + local)) if in_window(i, query, chunk[-1], has_more)]
            after = chunk[-1]
        assert sorted(seen) == sorted(set(fleet_ids + local)) and len(seen) == len(set(seen))
