"""The web page at ``/``: its headers and assets (no browser), then the page itself in headless
Chromium against a real server serving ``glm-mini``: a streamed chat whose text matches the API's,
the sessions list, fork / suspend / delete, a session made through the API shown (its messages from
``?messages=1``) and continued exactly, and the API-key prompt.

The browser tests need Chromium (Debian's ``chromium``) and the ``playwright`` package; without them
they fail, unless ``COLI_NO_BROWSER=1`` says this machine has no browser on purpose.
"""
from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from sessionstore.service.http.auth import BearerAuth
from sessionstore.service.http.webpage import ASSETS, CSP, WithPage, read_asset
from sessionstore.sessions import SessionOptions
from tests.service.serverkit import REPO, ServerProc
from tests.service.webkit import MAX_TOKENS, MODEL, Tab, browser  # noqa: F401 (browser: a fixture)
from tests.support.conversation_cut import respond_until_crash

WEB_DIR = REPO / "sessionstore" / "service" / "http" / "web"
SLOW_LINK_BYTES_S = 4000  # a reply of ~48 SSE events (~10 KB) then takes a few seconds to arrive


# ---- no browser ---------------------------------------------------------------------------------
@pytest.fixture
def page_client() -> TestClient:
    """The page in front of an API that wants key "k" (it answers "api" once let in)."""
    async def api(scope: Any, receive: Any, send: Any) -> None:
        await PlainTextResponse("api")(scope, receive, send)

    return TestClient(WithPage(BearerAuth(api, "k")))


def test_page_and_every_linked_asset_served_without_key(page_client: TestClient) -> None:
    page = page_client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    linked = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert {"/web/app.js", "/web/style.css"} <= set(linked)
    for path in ["/", *linked]:
        res = page_client.get(path)
        assert res.status_code == 200, path
        assert res.headers["content-security-policy"] == CSP and CSP.startswith("default-src 'self'")
        assert res.headers["cache-control"] == "no-cache"
        assert res.headers["content-type"].split(";")[0] == ASSETS[path][1].split(";")[0], path
        assert res.content == read_asset(ASSETS[path][0])
    assert page_client.head("/web/app.js").status_code == 200


def test_everything_else_still_needs_the_key(page_client: TestClient) -> None:
    assert page_client.get("/v1/sessions").status_code == 401
    assert page_client.post("/").status_code == 401  # only GET/HEAD of the page's paths are open
    assert page_client.get("/web/other.js").status_code == 401
    assert page_client.get("/v1/sessions", headers={"Authorization": "Bearer k"}).text == "api"


def test_page_is_csp_clean_and_ships_as_package_data() -> None:
    html = (WEB_DIR / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)", html), "inline script: CSP default-src 'self' blocks it"
    assert not re.search(r"\sstyle=|\son[a-z]+=|<style", html), "inline style or handler: CSP blocks it"
    assert not re.search(r"(?:src|href)=\"(?:https?:)?//", html), "the page loads nothing from elsewhere"
    scripts = sorted(WEB_DIR.glob("*.js"))
    assert {"app.js", "markdown.js"} <= {js.name for js in scripts}
    for js in scripts:  # text never becomes markup: no HTML parsing sinks, no eval
        code = js.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
            assert sink not in code, f"{js.name} uses {sink}"
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["sessionstore"]
    for name, _ in ASSETS.values():
        assert any(fnmatch.fnmatch(f"service/http/web/{name}", g) for g in globs), f"web/{name} is not package data"


# ---- in Chromium ----------------------------------------------------------------------------------
GROWTH_OBSERVER = """() => {
  window.growth = {pieces: 0, lengths: []};
  new MutationObserver((records) => {
    for (const r of records) {  // a render of the reply so far (as markdown) into its text box
      if (r.target.matches && r.target.matches('.msg.assistant .text') && r.addedNodes.length)
        window.growth.pieces += 1;
    }
    const last = [...document.querySelectorAll('.msg.assistant .text')].pop();
    if (last) window.growth.lengths.push(last.textContent.length);
  }).observe(document.getElementById('log'), {childList: true, subtree: true});
}"""


def _reference_reply(server: ServerProc, sid: str, messages: list[dict[str, str]]) -> str:
    body = {"model": MODEL, "messages": messages, "session": sid, "max_tokens": MAX_TOKENS}
    res = server.post("/v1/chat/completions", json=body)
    assert res.status_code == 200, res.text
    return str(res.json()["choices"][0]["message"]["content"])


def test_chat_streams_into_the_page_and_sessions_list(browser: Any, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    with ServerProc(tmp_path / "root", MODEL) as server:
        tab = Tab(browser, server.url)
        page = tab.page
        expect(page.locator("#model")).to_have_text(MODEL)
        tab.new_session("web-1")
        expect(tab.item("web-1").locator(".badge")).to_have_text("new")
        page.evaluate(GROWTH_OBSERVER)

        first = "Tell me a story about a <b>cat</b>."
        # a slow link (Chromium's own throttling): the reply's events arrive over many frames however
        # fast the server streams them (a fast one can send a whole reply within one frame)
        link = page.context.new_cdp_session(page)
        link.send("Network.enable")
        link.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "uploadThroughput": -1,
                                                       "downloadThroughput": SLOW_LINK_BYTES_S})
        reply = tab.send(first)
        link.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "uploadThroughput": -1,
                                                       "downloadThroughput": -1})
        growth = page.evaluate("window.growth")
        print(f"reply rendered in {growth['pieces']} pieces over {len(set(growth['lengths']))} lengths")
        assert reply.strip(), "the page showed no reply"
        assert growth["pieces"] >= 2, f"the reply was not rendered piece by piece: {growth}"
        # shown as markdown, at most once per animation frame: the whole reply's length is the last step,
        # and a page that only rendered the finished reply would show no length between 0 and that one
        # (a loaded machine may paint a 48-token reply in as few as two frames, so one is the bound)
        steps = sorted(set(growth["lengths"]))
        assert [n for n in steps if 0 < n < steps[-1]], f"the reply did not grow in steps: {growth}"
        assert page.locator(".msg.user .text").first.text_content() == first
        assert page.locator("#log b").count() == 0, "message text was rendered as HTML"

        # the page's messages are the API's: an identical session answers the same (greedy)
        messages = [{"role": "user", "content": first}]
        assert reply == _reference_reply(server, "ref", messages)
        second = tab.send("And then?")
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
        assert second == _reference_reply(server, "ref", messages)

        info = server.get("/v1/sessions/web-1").json()
        assert info["tokens"] == server.get("/v1/sessions/ref").json()["tokens"] > 0
        expect(tab.item("web-1").locator(".tokens")).to_have_text(str(info["tokens"]))
        expect(tab.item("web-1").locator(".badge")).to_have_text("resident")
        expect(page.locator("#chat-meta")).to_contain_text(f"{info['tokens']} tokens")

        tab.item("web-1").locator("button", has_text="fork").click()
        expect(tab.item("web-1.fork1")).to_have_class(re.compile(r"\bselected\b"))
        expect(page.locator(".msg.assistant .text")).to_have_count(2)  # the fork kept the conversation
        assert server.get("/v1/sessions/web-1.fork1").json()["tokens"] == info["tokens"]

        tab.item("web-1").locator("button", has_text="suspend").click()
        expect(tab.item("web-1").locator(".badge")).to_have_text("suspended")
        assert server.get("/v1/sessions/web-1").json()["state"] == "suspended"

        delete = tab.item("web-1.fork1").locator("button.delete")
        delete.click()
        expect(delete).to_have_text("sure?")
        delete.click()
        expect(tab.item("web-1.fork1")).to_have_count(0)
        assert server.get("/v1/sessions/web-1.fork1").status_code == 404

        # made through the API: its messages come from the server, and the page continues it exactly
        messages.append({"role": "assistant", "content": second})
        tab.item("ref").click()
        expect(page.locator(".msg")).to_have_count(len(messages))
        shown = page.eval_on_selector_all(".msg", "ns => ns.map((n) => ({role: n.querySelector('.role').textContent,"
                                          " content: n.querySelector('.text').dataset.source}))")
        assert shown == messages
        assert page.locator("#log b").count() == 0, "message text was rendered as HTML"
        expect(page.locator("#log-note")).to_be_hidden()
        for k in range(1, len(messages), 2):  # an identical session, made through the API alone
            assert _reference_reply(server, "twin", messages[:k]) == messages[k]["content"]
        third = tab.send("What did the cat do next?")
        messages.append({"role": "user", "content": "What did the cat do next?"})
        assert third == _reference_reply(server, "twin", messages)
        messages.append({"role": "assistant", "content": third})
        body = server.get("/v1/sessions/ref", params={"messages": "1"}).json()
        assert body["messages"] == messages == server.get("/v1/sessions/twin", params={"messages": "1"}).json()[
            "messages"]
        assert body["tokens"] == server.get("/v1/sessions/twin").json()["tokens"]
        page.screenshot(path=str(tmp_path / "web-page-continued.png"))
        print(f"screenshot: {tmp_path / 'web-page-continued.png'}")
        later = [*messages, {"role": "user", "content": "Thanks!"}]  # a turn by another client: the page follows
        later.append({"role": "assistant", "content": _reference_reply(server, "ref", later)})
        expect(page.locator(".msg")).to_have_count(len(later))
        expect(page.locator(".msg .text").last).to_have_attribute("data-source", later[-1]["content"])

        # a session of the completions API: no messages, and the page says why
        res = server.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "session": "raw",
                                                   "max_tokens": 4})
        assert res.status_code == 200, res.text
        expect(tab.item("raw")).to_have_count(1)
        tab.item("raw").click()
        expect(page.locator("#log-note")).to_contain_text("completions API")
        expect(page.locator("#log-note")).to_contain_text("starts its conversation over")
        expect(page.locator(".msg")).to_have_count(0)
        tab.item("web-1").click()
        expect(page.locator(".msg.assistant")).to_have_count(2)
        expect(page.locator("#key-button")).to_be_hidden()  # this server wants no key
        described = server.get("/v1/sessions/web-1").json()  # the size shown is what the session stored
        assert 0 < described["stored_bytes"] < described["bytes"]
        expect(tab.item("web-1").locator(".size")).to_have_text(page.evaluate(f"bytes({described['stored_bytes']})"))

        # a Responses chain's session: listed apart, as a chain, and gone with its last response
        made = server.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4})
        assert made.status_code == 200, made.text
        chain, = [s["id"] for s in server.get("/v1/sessions").json()["data"] if s["id"].startswith("chain-")]
        expect(page.locator("#api-group-title")).to_have_text("Responses API chains and conversations (1)")
        expect(page.locator("#session-list").locator(f'li[data-id="{chain}"]')).to_have_count(0)
        page.locator("#api-group-title").click()
        expect(page.locator("#api-list").locator(f'li[data-id="{chain}"] .badge.made')).to_have_text("chain")
        assert server.get(f"/v1/sessions/{chain}").status_code == 200
        assert httpx.delete(f"{server.url}/v1/responses/{made.json()['id']}", timeout=60).status_code == 200
        assert server.get(f"/v1/sessions/{chain}").status_code == 404
        expect(page.locator("#api-group")).to_be_hidden()
        shot = tmp_path / "web-page.png"
        page.screenshot(path=str(shot))
        print(f"screenshot: {shot}")
        assert tab.errors == [], f"console errors (CSP violations show here): {tab.errors}"


def test_api_key_prompt(browser: Any, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    with ServerProc(tmp_path / "root", MODEL, "--api-key", "sesame") as server:
        made = server.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "session": "there-before",
                                                    "max_tokens": 2})
        assert made.status_code == 200, made.text
        tab = Tab(browser, server.url)
        page = tab.page
        dialog = page.locator("#key-dialog")
        expect(dialog).to_be_visible()
        expect(page.locator("#key-reason")).to_contain_text("needs an API key")
        expect(page.locator("#empty-list")).to_contain_text("needs an API key")  # not "no sessions"
        expect(page.locator("#key-button")).to_be_visible()
        page.fill("#key-input", "wrong")
        page.click("#key-form button[type=submit]")
        expect(page.locator("#key-reason")).to_contain_text("refused")  # the 401 asked again
        expect(dialog).to_be_visible()
        page.fill("#key-input", "sesame")
        page.click("#key-form button[type=submit]")
        expect(dialog).to_be_hidden()
        expect(page.locator("#model")).to_have_text(MODEL)
        expect(tab.item("there-before")).to_have_count(1)  # the list shows once the key is given
        expect(page.locator("#empty-list")).to_be_hidden()

        tab.new_session("keyed")
        assert tab.send("Hello!").strip()
        assert server.get("/v1/sessions/keyed").json()["tokens"] > 0
        page.reload()  # the key, the open session and its messages are kept in this tab's sessionStorage
        expect(tab.item("keyed").locator(".badge")).to_have_text("resident")
        expect(tab.item("keyed")).to_have_class(re.compile(r"\bselected\b"))
        expect(page.locator(".msg")).to_have_count(2)
        expect(dialog).to_be_hidden()
        page.screenshot(path=str(tmp_path / "web-page-keyed.png"))
        print(f"screenshot: {tmp_path / 'web-page-keyed.png'}")


def _session_cut_mid_reply(root: Path) -> list[dict[str, str]]:
    """A glm-mini session under ``root`` whose second reply was cut after some committed tokens
    (its turn left open, as a crashed server leaves it); the messages sent for that turn."""
    from kernels.model import resolve_model
    from kernels.model.text import load_text
    from sessionstore.sessions import SessionStore
    from sessionstore.sessions.conversation_chat import Conversation

    source = resolve_model(MODEL)
    store = SessionStore(root)
    session = store.create("cut", source, kv_dtype="fp8", options=SessionOptions(commit_every=2))
    conv = Conversation.open(session, load_text(source))
    conv.say("Tell me a story about a cat.", 12)
    sent = [*conv.messages, {"role": "user", "content": "And then?"}]
    respond_until_crash(conv, sent, 40, checks=9)
    return sent


def test_a_turn_left_open_shows_its_committed_reply_as_partial_then_continues(browser: Any, tmp_path: Path) -> None:
    """The page's ``turn_partial`` view: a session whose reply was cut shows the sent messages and
    the committed part of the reply marked partial, with a note; a message sent from the page
    closes that turn (as recovery does) and the partial mark goes."""
    from playwright.sync_api import expect

    sent = _session_cut_mid_reply(tmp_path / "root")
    with ServerProc(tmp_path / "root", MODEL) as server:
        view = server.get("/v1/sessions/cut", params={"messages": "1"}).json()
        assert view["messages_state"] == "turn_partial", view
        assert view["messages"][:-1] == sent and view["messages"][-1]["role"] == "assistant"
        partial_reply = view["messages"][-1]["content"]
        assert partial_reply, "the cut reply committed nothing: the test needs a partial reply"
        tab = Tab(browser, server.url)
        page = tab.page
        tab.item("cut").click()
        expect(page.locator(".msg")).to_have_count(len(sent) + 1)
        expect(page.locator(".msg.partial")).to_have_count(1)
        last = page.locator(".msg").last
        expect(last).to_have_class(re.compile(r"\bassistant\b.*\bpartial\b|\bpartial\b.*\bassistant\b"))
        expect(last.locator(".text")).to_have_attribute("data-source", partial_reply)
        expect(page.locator("#log-note")).to_contain_text("A turn is open on this session")
        page.screenshot(path=str(tmp_path / "web-page-partial.png"))
        print(f"screenshot: {tmp_path / 'web-page-partial.png'}")

        reply = tab.send("What happened next?")
        assert reply.strip()
        expect(page.locator(".msg.partial")).to_have_count(0)
        expect(page.locator("#log-note")).to_be_hidden()
        after = server.get("/v1/sessions/cut", params={"messages": "1"}).json()
        assert after["messages_state"] == "complete"
        assert after["messages"][: len(sent) + 1] == view["messages"]  # the cut reply was closed as committed
        assert after["messages"][-1] == {"role": "assistant", "content": reply}
        assert tab.errors == [], f"console errors: {tab.errors}"


def test_the_list_shows_every_session_past_the_first_page(browser: Any, tmp_path: Path) -> None:
    """The server lists sessions a page at a time (at most 1,000); the page reads every page."""
    from playwright.sync_api import expect

    from bench.catalogue import build_store, make_template, sid_of

    n = 1203
    build_store(tmp_path / "root", make_template(tmp_path / "template"), n, set())
    with ServerProc(tmp_path / "root", MODEL) as server:
        assert server.get("/v1/sessions").json()["has_more"]  # one page of the API does not hold them all
        tab = Tab(browser, server.url)
        expect(tab.page.locator("li.session")).to_have_count(n)
        expect(tab.item(sid_of(n - 1))).to_have_count(1)
        assert not tab.errors, tab.errors
