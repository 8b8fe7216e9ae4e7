"""The status page (GET /): public, static, locked down by its CSP, and driven here in a real
headless Chromium (Debian's chromium through playwright) against a real corral with an admin
key: the key prompt, a loaded model with its pid, a request arriving live over the event
stream, the log tail, Unload and Load from the page, and hostile strings shown as text."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, expect, sync_playwright

from conftest import Corral, CorralFactory, tiny_config

ADMIN_KEY = "boss-key"
# A model name is the operator's, but it is still a string the page must never parse.
HOSTILE = '<img src=x onerror="window.pwned=1">'
# Room for a real llama-server to start on a tiny model, not for a page to dawdle.
UI_WAIT_MS = 15_000


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path]) -> Corral:
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b"], admin_api_keys=[ADMIN_KEY],
                         policy={"max_loaded": 4})
    config["models"][HOSTILE] = {"model": str(tiny_models["tiny-c"]), "ctx": 2048}
    config["groups"] = {"pair": {"type": "parallel", "models": ["tiny-a", "tiny-b"]}}
    return start_corral_module(config, api_key=ADMIN_KEY)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        chromium = p.chromium.launch(
            executable_path=shutil.which("chromium") or "/usr/bin/chromium",
            args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(UI_WAIT_MS)
    yield page
    context.close()


def test_the_page_is_public_static_and_locked_down(corral: Corral) -> None:
    resp = httpx.get(corral.url + "/")  # no key: the page holds no data
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/html; charset=utf-8"
    assert resp.headers["cache-control"] == "no-cache"
    assert resp.headers["x-content-type-options"] == "nosniff"
    csp = dict(part.strip().split(" ", 1) for part in
               resp.headers["content-security-policy"].split(";"))
    assert csp["default-src"] == "'none'" and csp["connect-src"] == "'self'"
    assert csp["frame-ancestors"] == "'none'"
    # Only the page's own inline script and style, by hash; nothing inline besides.
    assert re.fullmatch(r"'sha256-[A-Za-z0-9+/]{43}='", csp["script-src"])
    assert re.fullmatch(r"'sha256-[A-Za-z0-9+/]{43}='", csp["style-src"])
    assert "://" not in resp.text, "no third-party origin, no CDN"
    assert httpx.get(corral.url + "/ui").content == resp.content
    # The data behind it is not public.
    assert httpx.get(corral.url + "/admin/models").status_code == 401


def test_the_page_shows_models_live_and_loads_and_unloads_them(
        corral: Corral, page: Page, tmp_path: Path) -> None:
    assert corral.http.post("/admin/models/tiny-a/load").status_code == 200
    pid = corral.model("tiny-a")["pid"]
    assert pid

    problems: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        # A script or style blocked by the CSP is reported here.
        if message.type == "error" and "401" not in message.text:
            problems.append(message.text)

    page.on("console", on_console)
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    page.goto(corral.url + "/")

    # The page asks for the key; a wrong one is refused, the right one opens it.
    expect(page.locator("#keyform")).to_be_visible()
    page.fill("#key", "wrong-key")
    page.press("#key", "Enter")
    expect(page.locator("#keymsg")).to_contain_text("refused")
    page.fill("#key", ADMIN_KEY)
    page.press("#key", "Enter")
    expect(page.locator("#keyform")).to_be_hidden()
    expect(page.locator("#conn")).to_have_text("live")

    row = page.locator('#models tr[data-model="tiny-a"]')
    expect(row.locator(".state")).to_have_text("ready")
    expect(row.locator(".pid")).to_have_text(str(pid))
    expect(row.locator(".mem")).to_contain_text("MiB")
    expect(page.locator('#models tr[data-model="tiny-b"] .state')).to_have_text("stopped")
    expect(page.locator('#groups tr[data-group="pair"]')).to_contain_text("1/2")
    expect(page.locator("#devices .device")).not_to_have_count(0)

    # The hostile name is listed, as text.
    expect(page.locator("#models tbody tr").filter(has_text=HOSTILE)).to_have_count(1)
    assert page.locator("#models img").count() == 0
    assert page.evaluate("window.pwned") is None

    # A request made elsewhere arrives over the event stream: no reload, no polling of
    # /admin/requests (the page reads it only when an event says so).
    requests = page.locator('#requests tbody tr[data-model="tiny-a"]')
    expect(requests).to_have_count(0)
    assert corral.chat("tiny-a", max_tokens=3).status_code == 200
    expect(requests).to_have_count(1)
    expect(requests.first).to_contain_text("200")
    expect(requests.first).to_contain_text("hit")
    expect(page.locator('#events li[data-kind="request"]')).to_have_count(1)

    # A dropped stream (cut here from the page's side: `abort` is its stream's controller)
    # comes back after its back-off and replays what it missed by Last-Event-ID: the load
    # of tiny-b meanwhile. Requests are live-only events (they would crowd the history):
    # the page reads the request list again on reconnecting.
    page.evaluate("abort.abort()")
    expect(page.locator("#conn")).to_have_text("reconnecting…")
    assert corral.chat("tiny-a", max_tokens=3).status_code == 200
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert corral.http.post("/admin/models/tiny-b/load", headers=admin).status_code == 200
    expect(page.locator("#conn")).to_have_text("live")
    expect(page.locator('#events li[data-kind="loaded"]', has_text="tiny-b")).to_have_count(1)
    expect(requests).to_have_count(2)

    # The log tail of a model, on a click of its name.
    row.locator("button.name").click()
    expect(page.locator("#logname")).to_have_text("tiny-a")
    expect(page.locator("#log")).not_to_be_empty()
    shown = page.locator("#log").text_content() or ""
    lines = corral.http.get("/admin/models/tiny-a/logs?lines=50").json()["lines"]
    assert lines and lines[-1] in shown

    # Unload from the page: the page shows it stopped, and so does the admin API.
    row.locator("button.unload").click()
    expect(row.locator(".state")).to_have_text("stopped", timeout=UI_WAIT_MS)
    expect(row.locator(".pid")).to_have_text("")
    assert corral.model("tiny-a")["state"] == "stopped"
    expect(page.locator('#events li[data-kind="stop"]')).not_to_have_count(0)

    # Load from the page: a new child.
    row.locator("button.load").click()
    expect(row.locator(".state")).to_have_text("ready", timeout=UI_WAIT_MS)
    now = corral.model("tiny-a")
    assert now["state"] == "ready" and now["pid"] not in (None, pid)
    expect(row.locator(".pid")).to_have_text(str(now["pid"]))

    shot = tmp_path / "status-page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 1000

    # The key is remembered: a reload goes straight to the tables.
    page.reload()
    expect(page.locator("#keyform")).to_be_hidden()
    expect(row.locator(".state")).to_have_text("ready")
    assert not problems, problems
