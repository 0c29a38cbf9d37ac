"""The web page's chat tools in headless Chromium against a real server serving ``glm-mini``: the
system prompt field and the sampling controls (what the server received, and their effect), markdown
rendered safely (HTML in a reply is shown as text and never runs, from the server's messages and
from a stream), copy, regenerate, edit-and-resend (the session truncated at the first changed
token: its history equals a fresh session's over the edited messages), tokens/s and cached tokens
per reply, and the layout at phone width (no horizontal overflow at 390 px). Screenshots at 1280
and 390 px are kept under ``artefacts/web/`` at the repository root.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.service.serverkit import REPO, ServerProc
from tests.service.webkit import MODEL, Tab, browser  # noqa: F401 (browser: a fixture)

MARKDOWN_JS = REPO / "sessionstore" / "service" / "http" / "web" / "markdown.js"
ARTEFACTS = REPO / "artefacts" / "web"
SYSTEM = "You are a terse assistant who answers in one line."
# markup that runs if it is ever parsed as HTML (window.pwned set), in every markdown context
HOSTILE = ('Look: <script>window.pwned = 1</script> and <img src="x" onerror="window.pwned = 2">\n\n'
           '- **<img src="y" onerror="window.pwned = 3">** and *<svg onload="window.pwned = 4"></svg>*\n'
           '- `<script>window.pwned = 5</script>`\n\n'
           '```html\n<img src="z" onerror="window.pwned = 6">\n```\n\n'
           '[click](javascript:window.pwned=7) <iframe src="javascript:window.pwned = 8"></iframe>')
MARKUP = "#log script, #log img, #log svg, #log iframe, #log [onerror], #log [onload], #log a[href^=javascript]"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    with ServerProc(tmp_path_factory.mktemp("web-chat") / "root", MODEL) as srv:
        yield srv


def history(server: ServerProc, sid: str) -> list[int]:
    res = server.get(f"/v1/sessions/{sid}", params={"history": "1"})
    assert res.status_code == 200, res.text
    return list(res.json()["history"])


def stored_messages(server: ServerProc, sid: str) -> list[dict[str, str]]:
    return list(server.get(f"/v1/sessions/{sid}", params={"messages": "1"}).json()["messages"])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def chat_requests(tab: Tab) -> list[dict[str, Any]]:
    """The bodies of the chat requests the page sends from now on, as the server receives them."""
    sent: list[dict[str, Any]] = []

    def seen(request: Any) -> None:
        if request.method == "POST" and request.url.endswith("/v1/chat/completions"):
            sent.append(json.loads(request.post_data))

    tab.page.on("request", seen)
    return sent


def last_stats(tab: Tab) -> dict[str, str]:
    """The figures the page shows under its last reply."""
    line = tab.page.locator(".msg.assistant").last.locator(".stats")
    return dict(line.evaluate("n => ({...n.dataset, text: n.textContent})"))


def set_controls(tab: Tab, **values: str) -> None:
    tab.open_settings()
    for field, value in values.items():
        tab.page.fill(f"#{field.replace('_', '-')}", value)


def click_and_wait(tab: Tab, button: Any) -> str:
    tab.watch_finish()
    button.click()
    return tab.wait_reply()


# ---- the renderer on its own ----------------------------------------------------------------------
RENDER = "s => { const o = document.getElementById('out'); o.replaceChildren(Markdown.render(s)); return o.innerHTML; }"


@pytest.fixture
def renderer(browser: Any) -> Iterator[Any]:  # the fixture, imported
    page = browser.new_page()
    page.set_content("<div id=out></div>")  # no CSP here: markup that got through would run
    page.add_script_tag(path=str(MARKDOWN_JS))
    yield page
    page.close()


@pytest.mark.parametrize(("source", "html"), [
    ("**bold**, *em*, ~~gone~~, `a*b*`, snake_case_name and _it_",
     "<p><strong>bold</strong>, <em>em</em>, <del>gone</del>, <code>a*b*</code>, snake_case_name and <em>it</em></p>"),
    ("one\ntwo\n\nthree", "<p>one<br>two</p><p>three</p>"),
    ("```py\nif a < b:\n    pass\n```", '<pre><code data-lang="py">if a &lt; b:\n    pass</code></pre>'),
    ("```\nnot closed", "<pre><code>not closed</code></pre>"),
    ("- a\n- b\n  - c\n- d", "<ul><li>a</li><li>b<ul><li>c</li></ul></li><li>d</li></ul>"),
    ("3. three\n4. **four**", '<ol start="3"><li>three</li><li><strong>four</strong></li></ol>'),
    ("* loose\n\n* items", "<ul><li><p>loose</p></li><li><p>items</p></li></ul>"),
    ("## Title\n> quoted\n\n---", "<h2>Title</h2><blockquote><p>quoted</p></blockquote><hr>"),
    ("[ok](https://example.org/a) [no](javascript:alert(1))",
     '<p><a href="https://example.org/a" rel="noopener noreferrer nofollow" target="_blank">ok</a>'
     " [no](javascript:alert(1))</p>"),
    (r"\*not em\* and 2 * 3 * 4", "<p>*not em* and 2 * 3 * 4</p>"),
])
def test_markdown_blocks_and_spans(renderer: Any, source: str, html: str) -> None:
    assert renderer.evaluate(RENDER, source) == html


def test_markdown_never_makes_markup_from_text(renderer: Any) -> None:
    html = renderer.evaluate(RENDER, HOSTILE)
    renderer.wait_for_timeout(300)  # an <img onerror> would have fired by now
    assert renderer.evaluate("window.pwned") is None
    assert renderer.locator(MARKUP.replace("#log", "#out")).count() == 0, html
    text = renderer.locator("#out").text_content()
    assert '<script>window.pwned = 1</script>' in text and '<img src="x" onerror="window.pwned = 2">' in text


# ---- the page against the server ------------------------------------------------------------------
def test_system_prompt_and_controls_reach_the_server(browser: Any, server: ServerProc) -> None:
    from playwright.sync_api import expect

    tab = Tab(browser, server.url)
    sent = chat_requests(tab)
    tab.new_session("sys")
    set_controls(tab, system=SYSTEM, temperature="0.8", top_p="0.9", max_tokens="5")
    expect(tab.page.locator("#settings-summary")).to_contain_text("temperature 0.8")
    reply = tab.send("Hello there", max_tokens=None)

    body = sent[-1]
    assert body["messages"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.8, 0.9, 5)
    assert body["session"] == "sys" and body["stream_options"] == {"include_usage": True}
    assert stored_messages(server, "sys") == [*body["messages"], {"role": "assistant", "content": reply}]
    stats = last_stats(tab)  # max_tokens caps the reply: at most 5 tokens, "length" when it took all 5
    finish = tab.page.locator(".msg.assistant .text").last.get_attribute("data-finish")
    assert 1 <= int(stats["tokens"]) <= 5 and (finish == "length") == (int(stats["tokens"]) == 5), (stats, finish)
    assert int(stats["cached"]) == 0 and len(history(server, "sys")) <= int(stats["prompt"]) + 5
    if int(stats["tokens"]) > 1:  # a rate after the first token, or over the whole reply when the rest came at once
        assert "tok/s" in stats["text"] and float(stats["rate"]) > 0 and stats["rateOver"] in ("decode", "reply")
    else:
        assert "tok/s" not in stats["text"] and "rate" not in stats

    before = history(server, "sys")
    tab.send("And then?", max_tokens=None)  # the next turn reuses the session: its prompt's prefix is cached
    stats, after = last_stats(tab), history(server, "sys")
    # the whole old history matches; its last token was drawn and not yet fed (its rows come with
    # this turn), so every token before it is what was reused
    assert common_prefix(before, after) == len(before) and int(stats["cached"]) == len(before) - 1 > 0, stats
    assert int(stats["prompt"]) > int(stats["cached"])

    set_controls(tab, system="Answer in French.")  # a new system prompt: the session starts over from it
    before = history(server, "sys")
    tab.send("Bonjour", max_tokens=None)
    stats, after = last_stats(tab), history(server, "sys")
    assert int(stats["cached"]) == common_prefix(before, after) < 16, stats  # the template's head only
    assert sent[-1]["messages"][0] == {"role": "system", "content": "Answer in French."}
    assert stored_messages(server, "sys")[0] == {"role": "system", "content": "Answer in French."}

    tab.page.reload()  # the field shows the selected session's system prompt; the controls are kept
    expect(tab.page.locator(".msg")).to_have_count(7)
    expect(tab.page.locator("#system")).to_have_value("Answer in French.")
    expect(tab.page.locator("#temperature")).to_have_value("0.8")
    set_controls(tab, temperature="9")  # out of range: said, not sent
    tab.page.fill("#input", "too hot")
    tab.page.press("#input", "Enter")
    expect(tab.page.locator("#status")).to_contain_text("temperature must be")
    expect(tab.page.locator("#input")).to_have_value("too hot")
    assert len(sent) == 3
    assert tab.errors == [], tab.errors
    tab.close()


def test_regenerate_gives_a_new_reply_on_the_same_session(browser: Any, server: ServerProc) -> None:
    from playwright.sync_api import expect

    tab = Tab(browser, server.url)
    sent = chat_requests(tab)
    tab.new_session("regen")
    set_controls(tab, temperature="1", max_tokens="12")
    first = tab.send("Tell me a story.", max_tokens=None)
    prompt = int(last_stats(tab)["prompt"])
    replies = [first]
    for _ in range(4):  # sampled with a fresh seed each time: a reply differs within a few tries
        replies.append(click_and_wait(tab, tab.page.locator(".msg.assistant").last.locator("button.regenerate")))
        assert sent[-1]["messages"] == [{"role": "user", "content": "Tell me a story."}]  # the reply left out
        expect(tab.page.locator(".msg")).to_have_count(2)
        stats = last_stats(tab)
        # the whole prompt is in the session; its last token is fed again for the logits of the first draw
        assert int(stats["prompt"]) == prompt and int(stats["cached"]) == prompt - 1, stats
        assert stored_messages(server, "regen") == [{"role": "user", "content": "Tell me a story."},
                                                    {"role": "assistant", "content": replies[-1]}]
        assert len(history(server, "regen")) <= prompt + 12  # the old reply's tokens are gone
        if replies[-1] != first:
            break
    assert any(r != first for r in replies[1:]), f"four regenerations at temperature 1 all gave {first!r}"
    expect(tab.page.locator("button.regenerate")).to_have_count(1)  # the last reply's only
    assert tab.errors == [], tab.errors
    tab.close()


def test_edit_and_resend_truncates_the_session_at_the_first_changed_token(browser: Any,
                                                                          server: ServerProc) -> None:
    from playwright.sync_api import expect

    tab = Tab(browser, server.url, permissions=["clipboard-read", "clipboard-write"])
    sent = chat_requests(tab)
    tab.new_session("edit")
    set_controls(tab, temperature="0", max_tokens="8")
    tab.send("The first question.", max_tokens=None)
    second = tab.send("The second question.", max_tokens=None)
    before = history(server, "edit")
    expect(tab.page.locator(".msg")).to_have_count(4)

    tab.page.locator(".msg.assistant").last.locator("button", has_text="copy").click()
    expect(tab.page.locator(".msg.assistant").last.locator("button", has_text="copied")).to_have_count(1)
    assert tab.page.evaluate("navigator.clipboard.readText()") == second

    tab.page.locator(".msg.user").first.locator("button.edit").click()
    editor = tab.page.locator(".msg.user").first.locator(".editor")
    expect(editor.locator("textarea")).to_have_value("The first question.")
    editor.locator("textarea").fill("The first question, edited.")
    reply = click_and_wait(tab, editor.locator("button[type=submit]"))

    edited = [{"role": "user", "content": "The first question, edited."}]
    assert sent[-1]["messages"] == edited  # the later messages dropped
    expect(tab.page.locator(".msg")).to_have_count(2)
    assert stored_messages(server, "edit") == [*edited, {"role": "assistant", "content": reply}]
    after = history(server, "edit")
    shared = common_prefix(before, after)
    assert 0 < shared < len(before)
    assert int(last_stats(tab)["cached"]) == shared  # reused up to the first changed token, no further
    twin = server.post("/v1/chat/completions", json={"model": MODEL, "messages": edited, "session": "edit-twin",
                                                     "max_tokens": 8, "temperature": 0})
    assert twin.status_code == 200, twin.text
    assert after == history(server, "edit-twin")  # token for token a fresh session over the edited messages
    assert twin.json()["choices"][0]["message"]["content"] == reply
    assert tab.errors == [], tab.errors
    tab.close()


def test_html_in_replies_is_shown_as_text_never_run(browser: Any, server: ServerProc) -> None:
    from playwright.sync_api import expect

    messages = [{"role": "user", "content": "Show me markup."}, {"role": "assistant", "content": HOSTILE},
                {"role": "user", "content": "<img src=q onerror=\"window.pwned = 9\">"}]
    res = server.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "session": "hostile",
                                                    "max_tokens": 2})
    assert res.status_code == 200, res.text
    tab = Tab(browser, server.url)
    page = tab.page
    tab.item("hostile").click()  # from the server's messages
    expect(page.locator(".msg")).to_have_count(4)
    expect(page.locator(".msg.assistant .text strong")).to_have_count(1)  # the markdown around it is rendered
    page.wait_for_timeout(300)
    assert page.evaluate("window.pwned") is None
    assert page.locator(MARKUP).count() == 0
    assert "<script>window.pwned = 1</script>" in str(page.locator(".msg.assistant .text").first.text_content())

    def stream(route: Any) -> None:  # a reply streamed with the markup cut across pieces
        pieces = [HOSTILE[i:i + 7] for i in range(0, len(HOSTILE), 7)]
        chunks: list[dict[str, Any]] = [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}
                                        for p in pieces]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": len(pieces),
                                                "prompt_tokens_details": {"cached_tokens": 4}}})
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", stream)
    tab.new_session("streamed")
    assert tab.send("again", max_tokens=None) == HOSTILE
    page.wait_for_timeout(300)
    assert page.evaluate("window.pwned") is None
    assert page.locator(MARKUP).count() == 0
    assert "<iframe" in str(page.locator(".msg.assistant .text").last.text_content())
    assert last_stats(tab)["cached"] == "4"
    assert tab.errors == [], tab.errors
    tab.close()


LAYOUT = """() => {
  const width = document.documentElement.clientWidth;
  const out = [];
  for (const node of document.querySelectorAll('body *')) {
    if (node.closest('pre, dialog')) continue;  // a code block scrolls inside itself
    const r = node.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;  // not shown
    if (r.left < -1 || r.right > width + 1) out.push(`${node.tagName}.${node.className} ${r.left}..${r.right}`);
    const scrolls = ['auto', 'scroll'].includes(getComputedStyle(node).overflowX);
    if (scrolls && node.tagName !== 'TEXTAREA' && node.scrollWidth > node.clientWidth + 1)  // a pane scrolls sideways
      out.push(`${node.tagName}.${node.className} scrolls ${node.scrollWidth} > ${node.clientWidth}`);
  }
  return {width, scroll: document.documentElement.scrollWidth, body: document.body.scrollWidth, out};
}"""


@pytest.mark.parametrize(("name", "width", "height"), [("desktop-1280", 1280, 800), ("phone-390", 390, 844)])
def test_layout_and_screenshots(browser: Any, server: ServerProc, name: str, width: int,
                                height: int) -> None:
    from playwright.sync_api import expect

    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Show me some code and a list, please: " + "x" * 120},
                {"role": "assistant", "content": "Here is **the code**, with a long line:\n\n```python\n"
                 "def answer(question: str) -> str:\n    return " + repr("a fairly long string " * 8) + "\n```\n\n"
                 "1. first, with `inline code`\n2. second, *emphasised*\n   - a nested point\n\n"
                 "A word too long for a phone: " + "unbroken" * 12 + "."},
                {"role": "user", "content": "Thanks!"}]
    res = server.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "session": f"layout-{name}",
                                                    "max_tokens": 16})
    assert res.status_code == 200, res.text
    tab = Tab(browser, server.url, width=width, height=height)
    page = tab.page
    tab.item(f"layout-{name}").click()
    expect(page.locator(".msg")).to_have_count(5)
    expect(page.locator("#system")).to_have_value(SYSTEM)  # (folded away on a phone)
    tab.open_settings()
    tab.send("One more line, please.", max_tokens=12)
    expect(page.locator(".msg.assistant .stats")).to_have_count(1)
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTEFACTS / f"{name}-settings.png"))
    layout = page.evaluate(LAYOUT)
    assert layout["scroll"] <= width and layout["body"] <= width, layout
    assert layout["out"] == [], layout
    for control in ("#input", "#send", "#system", "#temperature", "#top-p", "#max-tokens",
                    ".msg.assistant button.regenerate", ".msg.assistant .stats"):
        box = page.locator(control).last.bounding_box()
        assert box is not None and 0 <= box["x"] and box["x"] + box["width"] <= width, (control, box)
    page.click("#settings summary")  # folded: the conversation as one reads it
    page.locator(".msg.assistant").nth(0).scroll_into_view_if_needed()
    page.screenshot(path=str(ARTEFACTS / f"{name}.png"))
    layout = page.evaluate(LAYOUT)
    assert layout["scroll"] <= width and layout["out"] == [], layout
    print(f"screenshots: {ARTEFACTS / name}.png, {ARTEFACTS / name}-settings.png")
    assert tab.errors == [], tab.errors
    tab.close()


def test_a_message_sent_before_the_list_shows_a_new_session_keeps_its_first_turn(browser: Any,
                                                                                 server: ServerProc) -> None:
    """A new session's second message sent while the sessions list (which does not show the session yet)
    is still loading: the page sends the first turn with it, from what it showed, never the new message
    alone (which would cut the session back to it)."""
    from playwright.sync_api import expect

    tab = Tab(browser, server.url)
    sent = chat_requests(tab)
    tab.page.evaluate("""() => {  // every sessions-list request answers 3 s late from now on
      const fetched = window.fetch;
      window.fetch = async (url, init) => {
        if (String(url).includes("/v1/sessions?")) await new Promise((ok) => setTimeout(ok, 3000));
        return fetched(url, init);
      };
    }""")
    tab.new_session("slow-list")
    set_controls(tab, temperature="0", max_tokens="4")
    first = tab.send("The first question.", max_tokens=None)
    expect(tab.item("slow-list").locator(".badge.draft")).to_have_count(1)  # the list has not caught up
    tab.send("The second question.", max_tokens=None)
    assert [m["content"] for m in sent[-1]["messages"]] == ["The first question.", first, "The second question."]
    expect(tab.page.locator(".msg")).to_have_count(4)
    assert [m["content"] for m in stored_messages(server, "slow-list")][:3] == [
        "The first question.", first, "The second question."]
    assert tab.errors == [], tab.errors
    tab.close()
