"""The status page (GET /): public, static, locked down by its CSP, and driven here in a real
headless Chromium (Debian's chromium through playwright) against a real corral with an admin
key: the key prompt, a loaded model with its pid, a request arriving live over the event
stream, the log tail, Unload and Load from the page, and hostile strings shown as text. Then
the history (GET /admin/history) of a real run, and the page's charts of it, down to the
pixels of a screenshot."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from chromium import chromium, new_page
from playwright.sync_api import Browser, ConsoleMessage, Page, expect

from conftest import Corral, CorralFactory, sse_lines, tiny_config, wait_until

ADMIN_KEY = "boss-key"
# A model name is the operator's, but it is still a string the page must never parse.
HOSTILE = '<img src=x onerror="window.pwned=1">'
# Room for a real llama-server to start on a tiny model, not for a page to dawdle.
UI_WAIT_MS = 15_000


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path]) -> Corral:
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b"], admin_api_keys=[ADMIN_KEY],
                         policy={"max_loaded": 2})
    config["models"][HOSTILE] = {"model": str(tiny_models["tiny-c"]), "ctx": 2048}
    config["groups"] = {"pair": {"type": "parallel", "models": ["tiny-a", "tiny-b"]}}
    return start_corral_module(config, api_key=ADMIN_KEY)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as launched:
        yield launched


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    with new_page(browser, UI_WAIT_MS) as opened:
        yield opened


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
    # The one URL in it names SVG's namespace (createElementNS), which is never fetched.
    text = resp.text.replace('"http://www.w3.org/2000/svg"', "")
    assert "://" not in text, "no third-party origin, no CDN"
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
    # A key no header can carry is said to be one, not thrown by fetch unseen.
    page.fill("#key", "ключ admin")
    page.press("#key", "Enter")
    expect(page.locator("#keymsg")).to_contain_text("ASCII")
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


# -- history -----------------------------------------------------------------------------------

# The chart geometry of status.html (CHART): the plot's bottom edge is y = 130.
PLOT_BOTTOM = 150 - 20
EVICT_RGB = (0xBC, 0x4C, 0x00)  # .mk-evict


@pytest.fixture(scope="module")
def history_run(corral: Corral) -> dict[str, Any]:
    """A run worth charting, once per module: requests to two models, then a load that
    evicts the least recently used of them (max_loaded: 2)."""
    for name in ("tiny-a", "tiny-b"):
        assert corral.http.post(f"/admin/models/{name}/load").status_code == 200
    # ignore_eos: a random tiny model may end at its first token, with no speed to chart.
    for _ in range(3):
        assert corral.chat("tiny-b", max_tokens=8, ignore_eos=True).status_code == 200
    for _ in range(3):
        assert corral.chat("tiny-a", max_tokens=8, ignore_eos=True).status_code == 200
    # tiny-b was used least recently: loading a third model stops it to make room.
    assert corral.http.post(f"/admin/models/{quote(HOSTILE, safe='')}/load").status_code == 200
    wait_until(lambda: corral.model("tiny-b")["state"] == "stopped", timeout=30)

    def sampled() -> dict[str, Any] | None:
        # The requests are in the history once a sample closed their step, and the children's
        # memory once a sample was taken after the memory loop first measured them (a step can
        # close on a reading from before: the two loops keep their own clocks).
        body = corral.http.get("/admin/history").json()
        models = {m["name"]: m["samples"] for m in body["models"]}
        done = sum(s["requests"] for s in models.get("tiny-a", []))
        measured = any(s["corral_mib"] > 0 for d in body["devices"] for s in d["samples"])
        return body if done >= 3 and measured else None

    return wait_until(sampled, timeout=30)


def test_history_holds_memory_requests_and_marks_of_a_real_run(
        corral: Corral, history_run: dict[str, Any]) -> None:
    body = history_run
    assert set(body) == {"step", "minutes", "now", "times", "devices", "models", "marks"}
    assert body["step"] == 5 and body["minutes"] == 60
    times = body["times"]
    assert times == sorted(times) and len(times) <= 720
    assert all(body["now"] - 3600 < t <= body["now"] for t in times)

    # Memory per device, with /admin/memory's keys: corral's children and everyone else.
    memory = {d["name"]: d for d in corral.http.get("/admin/memory").json()["devices"]}
    assert body["devices"] and {d["name"] for d in body["devices"]} == set(memory)
    for device in body["devices"]:
        assert device["kind"] == memory[device["name"]]["kind"]
        assert [s["time"] for s in device["samples"]] == times  # one per step
        for sample in device["samples"]:
            assert set(sample) == {"time", "total_mib", "used_mib", "corral_mib", "other_mib",
                                   "capacity_mib"}
            assert 0 <= sample["corral_mib"] <= sample["used_mib"] <= sample["total_mib"]
    # The children's memory is in some sample (tiny models: a few MiB, not nothing).
    assert any(s["corral_mib"] > 0 for d in body["devices"] for s in d["samples"])

    # Requests per model, with /admin/requests' keys, only for the steps that had some.
    models = {m["name"]: m["samples"] for m in body["models"]}
    assert sum(s["requests"] for s in models["tiny-b"]) == 3
    for sample in models["tiny-a"] + models["tiny-b"]:
        assert set(sample) == {"time", "requests", "errors", "tokens_in", "tokens_out",
                               "tokens_per_s"}
        assert sample["time"] in times and sample["requests"] > 0 and sample["errors"] == 0
        assert sample["tokens_out"] > 0 and sample["tokens_per_s"] > 0
    assert HOSTILE not in models  # loaded, never asked anything

    # Loads and the eviction as marks: the events themselves (same ids, same keys).
    marks = body["marks"]
    loaded = {m["model"] for m in marks if m["kind"] == "loaded"}
    assert {"tiny-a", "tiny-b", HOSTILE} <= loaded
    evicted = [m for m in marks if m["kind"] == "stop" and m["cause"] == "lru"]
    assert [m["model"] for m in evicted][-1:] == ["tiny-b"]
    assert "evicted" in evicted[-1]["reason"]
    assert {m["kind"] for m in marks} <= {"loaded", "load_failed", "stop", "state"}
    assert [m["id"] for m in marks] == sorted(m["id"] for m in marks)

    # Bounds: a shorter window, and only what is newer than a sample already read.
    short = corral.http.get("/admin/history?minutes=1").json()
    assert short["minutes"] == 1 and all(t > short["now"] - 60 for t in short["times"])
    newer = corral.http.get(f"/admin/history?since={times[-1]}").json()
    assert all(t > times[-1] for t in newer["times"])
    assert all(m["time"] > times[-1] for m in newer["marks"])
    for query in ("minutes=0", "minutes=61", "minutes=ten", "minutes=1.5", "since=nan",
                  "since=soon"):
        resp = corral.http.get(f"/admin/history?{query}")
        assert resp.status_code == 400, query
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == query.split("=")[0]
    # The admin's, like the rest of /admin.
    assert httpx.get(corral.url + "/admin/history").status_code == 401


def test_events_count_from_one_and_a_new_reader_may_start_with_the_last_ones(
        corral: Corral, history_run: dict[str, Any]) -> None:
    ids: list[int] = []
    kinds: list[str] = []
    with corral.http.stream("GET", "/admin/events?last=5") as resp:
        for line in sse_lines(resp):
            if line.startswith("id: "):
                ids.append(int(line[4:]))
            elif line.startswith("event: "):
                kinds.append(line[7:])
                if len(kinds) == 5:
                    break
    # This daemon's own count (one per event since it started), not a timestamp.
    assert ids == sorted(ids) and ids[-1] < 10_000
    assert "request" not in kinds  # live only, never replayed
    last = history_run["marks"][-1]
    assert last["id"] <= ids[-1]
    resp = corral.http.get("/admin/events?last=many")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "last"


def path_points(d: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in re.findall(r"([-\d.]+),([-\d.]+)", d)]


def decoded(browser: Browser, png: bytes) -> np.ndarray:
    """A PNG's pixels (height × width × RGBA), decoded by Chromium itself: no image library."""
    page = browser.new_page()
    try:
        img = page.evaluate("""async (src) => {
            const img = new Image();
            img.src = src;
            await img.decode();
            const canvas = document.createElement("canvas");
            canvas.width = img.width;
            canvas.height = img.height;
            const g = canvas.getContext("2d");
            g.drawImage(img, 0, 0);
            return {w: img.width, h: img.height,
                    data: Array.from(g.getImageData(0, 0, img.width, img.height).data)};
        }""", "data:image/png;base64," + base64.b64encode(png).decode())
    finally:
        page.close()
    return np.array(img["data"], dtype=np.uint8).reshape(img["h"], img["w"], 4)


def test_the_page_charts_the_history_with_load_and_eviction_marks(
        corral: Corral, history_run: dict[str, Any], browser: Browser, page: Page,
        tmp_path: Path) -> None:
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    page.goto(corral.url + "/")
    page.fill("#key", ADMIN_KEY)
    page.press("#key", "Enter")
    expect(page.locator("#conn")).to_have_text("live")

    # The last events from before the page opened are listed (the eviction among them).
    expect(page.locator('#events li[data-kind="stop"]', has_text="(lru)")).not_to_have_count(0)

    requests = page.locator('[data-chart="requests"] path.line[data-model="tiny-a"]')
    speed = page.locator('[data-chart="speed"]')
    memory = page.locator("[data-device] path.line.corral").first
    expect(requests).to_have_count(1)

    def drawn_as_served() -> bool:
        # The page reads the history each step; compare once it has read what the API has.
        body = corral.http.get("/admin/history").json()
        served = {m["name"]: m["samples"] for m in body["models"]}["tiny-a"]
        steps = [(x, y) for x, y in path_points(requests.get_attribute("d") or "")]
        busy = [p for p in steps if p[1] < PLOT_BOTTOM - 0.05]
        dots = speed.locator("circle").count()
        timed = sum(1 for m in body["models"] for s in m["samples"]
                    if s["tokens_per_s"] is not None)
        kept = len(path_points(memory.get_attribute("d") or ""))
        return (len(busy) == sum(1 for s in served if s["requests"])
                and [x for x, _ in steps] == sorted(x for x, _ in steps)
                and dots == timed and kept in (len(body["times"]), len(body["times"]) - 1))

    wait_until(drawn_as_served, timeout=20)

    # Every chart marks the loads and the eviction on its timeline.
    charts = page.locator("#charts figure.chart")
    assert charts.count() >= 3
    for n in range(charts.count()):
        chart = charts.nth(n)
        assert chart.locator('line.mark[data-kind="evict"][data-model="tiny-b"]').count() >= 1
        assert chart.locator('line.mark[data-kind="load"]').count() >= 3
    evict_x = float(page.locator('[data-chart="requests"] line.mark[data-kind="evict"]')
                    .last.get_attribute("x1") or 0)
    load_xs = [float(x or 0) for x in page.locator('[data-chart="requests"] '
                                                    'line.mark[data-kind="load"]')
               .evaluate_all("lines => lines.map(l => l.getAttribute('x1'))")]
    assert max(load_xs) >= evict_x  # the third model's load came with the eviction

    # Screenshot-level: the requests chart is drawn, not blank, with its eviction mark in
    # the mark's own colour and the lines of the models.
    shot = page.locator('[data-chart="requests"] svg.plot').screenshot()
    (tmp_path / "history-requests.png").write_bytes(shot)
    pixels = decoded(browser, shot)[..., :3].astype(int)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 500
    assert pixels.std() > 10, "the chart is blank"
    near_evict = (np.abs(pixels - np.array(EVICT_RGB)).sum(axis=2) < 60).sum()
    assert near_evict >= 50, "no eviction mark in the screenshot"
    colours = {tuple(p) for p in pixels.reshape(-1, 3)[::7]}
    assert len(colours) > 20
    page.screenshot(path=str(tmp_path / "status-page.png"), full_page=True)
    assert not problems, problems
