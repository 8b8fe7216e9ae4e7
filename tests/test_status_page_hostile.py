"""The status page against strings it does not control, in a real headless Chromium: model,
alias and group names from a config someone else wrote (a preset off the internet), a child's
log lines, a failed start's error. Each reaches the page as text and runs nothing; names that
are also the names of what every JavaScript object inherits ("constructor", "__proto__") are
shown as themselves; the history's marks stay bounded however many a busy hour brings; and
every answer but the page itself says it is data, never a document a browser may run; and
the admin key lives as long as the tab, never on disk."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from chromium import chromium, new_page
from playwright.sync_api import Browser, Page, Route, expect

from conftest import Corral, CorralFactory

ADMIN_KEY = "boss-key"
FAKE = Path(__file__).resolve().parent / "fake_upstream.py"
IMG = '<img src=x onerror="window.pwned=1">'
SCRIPT = "</script><script>window.pwned=2</script>"
SVG = '<svg onload="window.pwned=3">'
UI_WAIT_MS = 15_000


def child(*lines: str) -> list[str]:
    """A `command` child that prints `lines`, then serves as tests/fake_upstream.py does."""
    return ["/bin/sh", "-c", f'printf "%s\\n" "$@"; exec {sys.executable} -S {FAKE} --port "$0"',
            "${PORT}", *lines]


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory) -> Corral:
    model = {"backend": "command", "command": child(IMG, SCRIPT), "memory_mb": 10}
    config = {"admin_api_keys": [ADMIN_KEY], "defaults": {"ttl": 300}, "models": {
        "constructor": dict(model),
        "toString": dict(model),
        SCRIPT: dict(model, aliases=[IMG]),
    }, "groups": {
        # Names of what every object inherits, and markup.
        "__proto__": {"type": "parallel", "models": ["constructor", "toString"]},
        "valueOf": {"type": "parallel", "models": ["constructor", SCRIPT]},
        SVG: {"type": "parallel", "models": ["toString"]},
    }}
    return start_corral_module(config, api_key=ADMIN_KEY)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as launched:
        yield launched


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    with new_page(browser, UI_WAIT_MS) as opened:
        yield opened


def open_page(corral: Corral, page: Page, problems: list[str]) -> None:
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    page.goto(corral.url + "/")
    page.fill("#key", ADMIN_KEY)
    page.press("#key", "Enter")
    expect(page.locator("#conn")).to_have_text("live")


def test_hostile_names_and_log_lines_are_shown_as_text(corral: Corral, page: Page) -> None:
    for name in ("constructor", SCRIPT):
        assert corral.http.post(f"/admin/models/{quote(name, safe='')}/load").status_code == 200
    problems: list[str] = []
    open_page(corral, page, problems)

    hostile = page.locator("#models tbody tr").filter(has_text=SCRIPT)
    expect(hostile.locator(".state")).to_have_text("ready")
    expect(page.locator("#groups tbody tr").filter(has_text=SVG)).to_have_count(1)
    hostile.locator("button.name").click()
    # The child's own lines, markup and all, as the text of the log.
    expect(page.locator("#log")).to_contain_text(IMG)
    expect(page.locator("#log")).to_contain_text(SCRIPT)
    assert page.locator("main img, main script, main svg:not(.plot):not([viewBox])").count() == 0
    assert page.evaluate("window.pwned") is None
    assert not problems, problems


def test_names_an_object_inherits_are_names_like_any_other(corral: Corral, page: Page) -> None:
    """A group or model named "constructor", "toString", "__proto__" or "valueOf": the page
    kept them in plain objects, where such a name read what every object inherits. A group
    that never ran showed "undefined in  ms" as its last run."""
    problems: list[str] = []
    open_page(corral, page, problems)
    rows = {name: page.locator(f'#groups tr[data-group="{name}"]')
            for name in ("__proto__", "valueOf")}
    for row in rows.values():
        expect(row).to_have_count(1)
        expect(row.locator("td").nth(4)).to_have_text("")  # no run yet
    # A run of one is shown on its row, and only there.
    answer = corral.http.post("/v1/batch/execute", json={
        "group": "__proto__", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200, answer.text
    expect(rows["__proto__"].locator("td").nth(4)).to_contain_text(" in ")
    expect(rows["__proto__"].locator("td").nth(4)).not_to_contain_text("undefined")
    expect(rows["valueOf"].locator("td").nth(4)).to_have_text("")
    # A model named after an inherited method shows its own footprint: none before its
    # memory is known, its MiB once the group's run started it and the memory loop read it
    # (either, by when the page looks), never what every object inherits.
    mem = page.locator('#models tr[data-model="toString"] .mem')
    expect(mem).to_have_text(re.compile(r"^(|\d[\d,.]* MiB)$"))
    assert re.fullmatch(r"(|cpu: \d[\d,.]* MiB)", mem.get_attribute("title") or ""), \
        mem.get_attribute("title")
    assert not problems, problems


def test_the_page_keeps_no_more_marks_than_the_history_does(corral: Corral, page: Page) -> None:
    """GET /admin/history?since= brings only what is new, the page merges it: a model swapped
    in and out all hour (a swap per request) brought 2 marks a swap, each drawn in every chart
    at every step, until the page had tens of thousands. The history itself keeps 1,000
    (proxy/history.py); so does the page. Here the history is served to the page as a busy
    hour's would be, 400 new marks a read, a read every 0.2 s."""
    served = {"reads": 0, "next_id": 1}

    def busy_hour(route: Route) -> None:
        now = time.time()
        marks: list[dict[str, Any]] = []
        for _ in range(400):
            n = served["next_id"]
            served["next_id"] += 1
            marks.append({"id": n, "time": now - 600 + n * 0.01, "kind": "stop", "model": "m",
                          "instance": "m", "reason": "unload", "cause": "unload"})
        served["reads"] += 1
        route.fulfill(status=200, content_type="application/json", body=json.dumps({
            "step": 0.2, "minutes": 60, "now": now, "times": [now - 700 + served["reads"]],
            "devices": [], "models": [], "marks": marks}))

    page.route("**/admin/history*", busy_hour)
    problems: list[str] = []
    open_page(corral, page, problems)
    marks = page.locator('[data-chart="requests"] line.mark')
    expect(marks).not_to_have_count(0)
    # Enough reads for 4,000 marks, then one more drawing of them.
    page.wait_for_function("() => hist && hist.marks.size > 0 && document.querySelectorAll("
                           "'[data-chart=\"requests\"] line.mark').length > 0")
    deadline = time.monotonic() + 30
    while served["reads"] < 12 and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    assert served["reads"] >= 12
    page.evaluate("renderHistory()")
    assert marks.count() == 1000
    # The newest ones: the last id served is drawn, the first long gone.
    assert page.evaluate("Math.min(...hist.marks.keys())") > served["next_id"] - 1 - 1000 - 400
    assert page.evaluate("hist.marks.has(1)") is False
    assert not problems, problems


def test_every_answer_but_the_page_is_data_a_browser_runs_nothing_from(
        corral: Corral) -> None:
    admin = corral.http
    answers = {
        "admin JSON": admin.get("/admin/models"),
        "admin error": admin.get("/admin/models/nope/logs"),
        "admin without key": httpx.get(corral.url + "/admin/config"),
        "not found": httpx.get(corral.url + "/nowhere"),
        "models": admin.get("/v1/models"),
        "relayed answer": admin.post("/v1/chat/completions", json={
            "model": "toString", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1}),
        "edge refusal": httpx.get(corral.url + "/admin/models",
                                  headers={"Origin": "http://evil.example"}),
    }
    with admin.stream("GET", "/admin/events") as events:
        answers["admin events"] = events
    for what, resp in answers.items():
        assert resp.headers.get("x-content-type-options") == "nosniff", what
        csp = resp.headers.get("content-security-policy", "")
        assert "default-src 'none'" in csp and "sandbox" in csp, (what, csp)
        assert "frame-ancestors 'none'" in csp, what
    for what in ("admin JSON", "admin error", "admin without key", "admin events"):
        assert answers[what].headers["cache-control"] == "no-store", what
    assert answers["relayed answer"].status_code == 200
    assert answers["admin events"].headers["content-type"] == "text/event-stream"
    # The page keeps its own policy: its script by hash.
    page = httpx.get(corral.url + "/")
    assert "script-src 'sha256-" in page.headers["content-security-policy"]
    assert "sandbox" not in page.headers["content-security-policy"]


def test_the_key_lives_as_long_as_the_tab_never_on_disk(corral: Corral,
                                                         browser: Browser) -> None:
    """The page kept the admin key in localStorage: on disk, for good, readable by whatever
    page is served at the same host and port later. Now the tab's sessionStorage: a reload
    keeps it, a new tab asks again, and a key an older page left in localStorage is moved."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(UI_WAIT_MS)
        problems: list[str] = []
        open_page(corral, page, problems)
        expect(page.locator("#models tbody tr")).not_to_have_count(0)
        assert page.evaluate("localStorage.getItem('corral.adminKey')") is None
        assert page.evaluate("sessionStorage.getItem('corral.adminKey')") == ADMIN_KEY
        page.reload()
        expect(page.locator("#conn")).to_have_text("live")
        expect(page.locator("#keyform")).to_be_hidden()

        fresh = context.new_page()  # another tab: no key
        fresh.set_default_timeout(UI_WAIT_MS)
        fresh.goto(corral.url + "/")
        expect(fresh.locator("#keyform")).to_be_visible()
        # A key an older page stored for good: used in this tab, gone from the disk.
        fresh.evaluate(f"localStorage.setItem('corral.adminKey', {json.dumps(ADMIN_KEY)})")
        fresh.reload()
        expect(fresh.locator("#conn")).to_have_text("live")
        assert fresh.evaluate("localStorage.getItem('corral.adminKey')") is None
        assert fresh.evaluate("sessionStorage.getItem('corral.adminKey')") == ADMIN_KEY
        # "Change key" forgets it.
        fresh.click("#forget")
        expect(fresh.locator("#keyform")).to_be_visible()
        assert fresh.evaluate("sessionStorage.getItem('corral.adminKey')") is None
        assert not problems, problems
    finally:
        context.close()
