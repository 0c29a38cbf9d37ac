"""The browser side of the web page tests: Debian's Chromium driven by playwright (the ``browser``
fixture, module-scoped) and :class:`Tab`, one page of the app with its console errors collected.

Without Chromium or playwright the browser tests fail, unless ``COLI_NO_BROWSER=1`` says this
machine has no browser on purpose (then they skip).
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

MODEL = "glm-mini"
MAX_TOKENS = 48


def _chromium() -> str:
    for candidate in (os.environ.get("COLI_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        found = candidate and shutil.which(candidate)
        if found:
            return found
    raise LookupError("no Chromium found")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright

        path, missing = _chromium(), ""
    except (ImportError, LookupError) as exc:
        missing = str(exc)
    if missing and os.environ.get("COLI_NO_BROWSER") == "1":
        pytest.skip(f"COLI_NO_BROWSER=1: no browser test ({missing})")
    if missing:
        pytest.fail(f"the web page tests need Chromium and playwright ({missing}): apt-get install chromium, "
                    "pip install -e .[test], or set COLI_CHROMIUM=/path/to/chrome; COLI_NO_BROWSER=1 skips them",
                    pytrace=False)
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=path, headless=True)
        yield chromium
        chromium.close()


class Tab:
    """One page of the app (in a context of its own), with its console errors collected."""

    def __init__(self, browser: Any, url: str, width: int = 1200, height: int = 780, **context: Any) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": height}, **context)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.set_default_timeout(60_000)
        self.page.goto(url + "/")

    def item(self, sid: str) -> Any:
        return self.page.locator(f'li.session[data-id="{sid}"]')

    def new_session(self, sid: str) -> None:
        self.page.fill("#new-id", sid)
        self.page.click("#new-form button")

    def open_settings(self) -> None:
        if not self.page.locator("#settings").evaluate("d => d.open"):
            self.page.click("#settings summary")

    def watch_finish(self) -> None:
        """Count the replies that end from now on (the page sets data-finish on a reply's text once
        its stream ended; a log rendered again from the server's messages shows none)."""
        self.page.evaluate("""() => {
          window.finishes = 0;
          if (window.finishWatch) return;
          window.finishWatch = new MutationObserver((records) => { window.finishes += records.length; });
          window.finishWatch.observe(document.getElementById('log'),
                                     {attributes: true, subtree: true, attributeFilter: ['data-finish']});
        }""")

    def wait_reply(self) -> str:
        """The text of the reply that ended since :meth:`watch_finish` (as sent: data-source)."""
        self.page.wait_for_function("() => window.finishes > 0")
        return str(self.page.locator(".msg.assistant .text").last.get_attribute("data-source"))

    def send(self, text: str, max_tokens: int | None = MAX_TOKENS) -> str:
        """Send ``text``; the reply the page shows once its stream finished."""
        from playwright.sync_api import expect

        expect(self.page.locator("#send")).to_be_enabled()  # the selected session's messages are loaded
        if max_tokens is not None:
            self.open_settings()
            self.page.fill("#max-tokens", str(max_tokens))
        self.page.fill("#input", text)
        self.watch_finish()
        self.page.press("#input", "Enter")
        return self.wait_reply()

    def close(self) -> None:
        self.context.close()
