"""Chromium for the browser tests: Playwright driving the distro's Chromium, which README's
test set-up installs."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

from playwright.sync_api import Browser, Page, sync_playwright


@contextlib.contextmanager
def chromium(*args: str) -> Iterator[Browser]:
    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium") or "/usr/bin/chromium",
            args=["--no-sandbox", *args])
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def new_page(browser: Browser, wait_ms: int) -> Iterator[Page]:
    """A page in a context of its own (no storage shared with other tests' pages)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(wait_ms)
    try:
        yield page
    finally:
        context.close()
