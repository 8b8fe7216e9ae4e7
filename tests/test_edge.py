"""The edge on a real corral: no web page can drive it (Host, Origin, content type), in a real
headless Chromium too (pages from other origins, a DNS-rebinding-style read), and the
configured origins get proper CORS. Then hypothesis throws Host, Origin, Content-Type, key
and path combinations at it: no state changes without the right key and origin."""

from __future__ import annotations

import http.server
import socket
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chromium import chromium
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from playwright.sync_api import Browser

from conftest import Corral, CorralFactory, tiny_config, wait_until

ADMIN = "edge-admin"
USER = "edge-user"


def _reserve() -> socket.socket:
    """A port of this module's from its import on: bound, not listening and without
    SO_REUSEADDR, so no one else binds it (reuse flag or not) until _serve listens on this
    very socket. The ports are named at collection, minutes before their servers start: a
    port picked free and closed could be another xdist worker's child's by then."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


_RESERVED = {sock.getsockname()[1]: sock for sock in (_reserve() for _ in range(3))}
FRIEND_PORT, EVIL_PORT, MISSING_PORT = _RESERVED
# FRIEND: a web app the operator allows; EVIL: any other page the user happens to open.
FRIEND = f"http://127.0.0.1:{FRIEND_PORT}"
# A source that fails at once if a pull ever starts (a server that answers 404).
SOURCE = f"http://127.0.0.1:{MISSING_PORT}/x.gguf"


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Corral:
    # An empty folder to pull into: a pull that starts shows in /admin/pulls.
    pulled = tmp_path_factory.mktemp("pulled")
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b"], api_keys=[USER],
                         models_dir=str(pulled),
                         admin_api_keys=[ADMIN], allowed_origins=[FRIEND],
                         allowed_hosts=[".corral.test"])
    corral = start_corral_module(config, api_key=ADMIN)
    corral.expect("pull.failed", "pull.retry")
    return corral


@pytest.fixture(scope="module", autouse=True)
def missing_file() -> Iterator[None]:
    server = _serve(MISSING_PORT, "", status=404)
    yield
    server.shutdown()
    server.server_close()


def _pulls(corral: Corral) -> int:
    return len(corral.http.get("/admin/pulls").json()["pulls"])


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text)
    error: dict[str, Any] = resp.json()["error"]
    return error


def test_a_foreign_host_is_refused_and_corrals_own_names_are_not(corral: Corral) -> None:
    port = corral.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example",
                 f"localhost.evil.example:{port}"):
        error = _error(corral.http.get("/v1/models", headers={"Host": host}), 403)
        assert error["code"] == "host_not_allowed" and "allowed_hosts" in error["message"]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "10.1.2.3",
                 f"app.localhost:{port}", f"box.corral.test:{port}", "corral.test"):
        assert corral.http.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_cross_origin_requests_are_refused_and_nothing_happens(corral: Corral) -> None:
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    before = _pulls(corral)
    evil = {"Origin": f"http://127.0.0.1:{EVIL_PORT}", "Content-Type": "application/json"}
    for path, body in (("/admin/pull", {"source": SOURCE}),
                       ("/admin/models/tiny-a/unload", None),
                       ("/v1/chat/completions", {"model": "tiny-a", "messages": [
                           {"role": "user", "content": "hi"}], "max_tokens": 1})):
        resp = corral.http.post(path, json=body, headers=evil)
        error = _error(resp, 403)
        assert error["code"] == "origin_not_allowed" and "allowed_origins" in error["message"]
        assert "access-control-allow-origin" not in resp.headers
    # A read of what runs, too (its answer would be hidden by the browser, but not its cost).
    assert _error(corral.http.get("/admin/models", headers=evil), 403)["code"] == \
        "origin_not_allowed"
    assert _pulls(corral) == before
    assert corral.model("tiny-a")["state"] == "ready"


def test_a_body_must_say_it_is_json(corral: Corral) -> None:
    before = _pulls(corral)
    chat = b'{"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}]}'
    for path, body in (("/admin/pull", b'{"source": "%s"}' % SOURCE.encode()),
                       ("/v1/chat/completions", chat), ("/models/load", b'{"model": "tiny-b"}'),
                       ("/v1/batch/execute", b'{"group": "x", "messages": []}')):
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"Content-Type": content_type} if content_type else {}
            resp = corral.http.post(path, content=body, headers=headers)
            assert _error(resp, 415)["code"] == "unsupported_media_type", (path, content_type)
    assert corral.model("tiny-b")["state"] == "stopped"
    assert _pulls(corral) == before


def test_a_configured_origin_gets_cors_and_a_childs_own_cors_header_never_passes(
        corral: Corral) -> None:
    preflight = httpx.options(corral.url + "/v1/chat/completions", headers={
        "Origin": FRIEND, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == FRIEND
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization,content-type"
    refused = httpx.options(corral.url + "/v1/chat/completions", headers={
        "Origin": f"http://127.0.0.1:{EVIL_PORT}", "Access-Control-Request-Method": "POST"})
    assert refused.status_code == 403
    answer = corral.http.post("/v1/chat/completions", headers={"Origin": FRIEND}, json={
        "model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert answer.status_code == 200
    assert answer.headers.get_list("access-control-allow-origin") == [FRIEND]
    # Without an Origin: no CORS header at all (llama-server's empty one is not relayed).
    plain = corral.chat("tiny-a", max_tokens=1)
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_the_operator_and_corrals_own_page_still_may(corral: Corral) -> None:
    """The positive control of the refusals above (and of the fuzz below): the same pull,
    from a non-browser client or from corral's own origin, starts."""
    own = corral.url.removeprefix("http://")
    for origin in (None, f"http://{own}"):
        before = _pulls(corral)
        headers = {"Origin": origin} if origin else {}
        resp = corral.http.post("/admin/pull", json={"source": SOURCE}, headers=headers)
        assert resp.status_code == 202, resp.text
        assert _pulls(corral) == before + 1
        wait_until(lambda: corral.http.get("/admin/pulls").json()["pulls"][-1]["state"]
                   != "running", timeout=10)


# -- a real browser --------------------------------------------------------------------------

ATTACK = """<!doctype html><script>
const corral = "%(corral)s";
async function attack() {
  const tries = [
    [corral + "/admin/pull", '{"source": "%(source)s"}'],
    [corral + "/admin/models/tiny-a/unload", ""],
    [corral + "/v1/chat/completions",
     '{"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'],
  ];
  for (const [url, body] of tries) {
    try { await fetch(url, {method: "POST", mode: "no-cors", body}); } catch (e) {}
    try {
      await fetch(url, {method: "POST", mode: "no-cors", body: new Blob([body])});
    } catch (e) {}
  }
  window.done = true;
}
attack();
</script>"""

FRIENDLY = """<!doctype html><script>
const corral = "%(corral)s";
async function use() {
  const models = await (await fetch(corral + "/v1/models",
      {headers: {"Authorization": "Bearer %(key)s"}})).json();
  const chat = await fetch(corral + "/v1/chat/completions", {method: "POST",
      headers: {"Authorization": "Bearer %(key)s", "Content-Type": "application/json"},
      body: JSON.stringify({model: "tiny-a", max_tokens: 1,
                            messages: [{role: "user", content: "hi"}]})});
  window.result = {models: models.data.map(m => m.id), chat: chat.status};
}
use().catch(e => { window.result = {error: String(e)}; });
</script>"""


def _serve(port: int, html: str, status: int = 200) -> socketserver.TCPServer:
    body = html.encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: Any) -> None:
            pass

    server = socketserver.ThreadingTCPServer(("127.0.0.1", port), Page, bind_and_activate=False)
    server.socket.close()
    server.socket = _RESERVED.pop(port)
    server.server_activate()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def browser(corral: Corral) -> Iterator[Browser]:
    # rebind.test: a name of the attacker's that resolves to 127.0.0.1 (rebinding).
    with chromium("--host-resolver-rules=MAP rebind.test 127.0.0.1") as launched:
        yield launched


def test_pages_from_other_origins_cannot_drive_corral_in_a_real_browser(
        corral: Corral, browser: Browser) -> None:
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    pid, pulls = corral.model("tiny-a")["pid"], _pulls(corral)
    served = len(corral.http.get("/admin/requests").json()["requests"])
    evil = _serve(EVIL_PORT, ATTACK % {"corral": corral.url, "source": SOURCE})
    try:
        context = browser.new_context()
        page = context.new_page()
        page.goto(f"http://127.0.0.1:{EVIL_PORT}/")
        page.wait_for_function("window.done === true", timeout=15_000)
        # And a page that DNS rebinding made corral's own origin: it may not even load.
        rebound = page.goto(corral.url.replace("127.0.0.1", "rebind.test") + "/admin/models")
        assert rebound is not None and rebound.status == 403
        assert "host_not_allowed" in (rebound.text() or "")
        context.close()
    finally:
        evil.shutdown()
        evil.server_close()
    assert _pulls(corral) == pulls, "a web page started a pull"
    assert corral.model("tiny-a")["state"] == "ready" and corral.model("tiny-a")["pid"] == pid
    requests = corral.http.get("/admin/requests").json()["requests"]
    assert len([r for r in requests if r.get("status") == 200]) == \
        len([r for r in requests[:served] if r.get("status") == 200]), requests[served:]


def test_the_configured_origin_works_in_a_real_browser(corral: Corral,
                                                        browser: Browser) -> None:
    friend = _serve(FRIEND_PORT, FRIENDLY % {"corral": corral.url, "key": USER})
    try:
        context = browser.new_context()
        page = context.new_page()
        page.goto(FRIEND + "/")
        page.wait_for_function("window.result !== undefined", timeout=30_000)
        result = page.evaluate("window.result")
        context.close()
    finally:
        friend.shutdown()
        friend.server_close()
    assert result == {"models": ["tiny-a", "tiny-b"], "chat": 200}, result


# -- fuzz --------------------------------------------------------------------------------------

HOSTS = st.sampled_from(["{host}", "localhost:{port}", "evil.example", "rebind.test:{port}",
                         "box.corral.test", "127.0.0.1.nip.io:{port}"])
ORIGINS = st.sampled_from([None, "null", FRIEND, f"http://127.0.0.1:{EVIL_PORT}",
                           "http://{host}", "https://{host}", "http://evil.example"])
TYPES = st.sampled_from([None, "application/json", "text/plain",
                         "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         "application/json; charset=utf-8"])
KEYS = st.sampled_from([None, USER, ADMIN, "wrong"])


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(host=HOSTS, origin=ORIGINS, content_type=TYPES, key=KEYS,
       path=st.sampled_from(["/admin/pull", "/admin/pull/", "/admin/pulls"]))
def test_no_state_changes_without_the_right_key_and_origin(
        corral: Corral, host: str, origin: str | None, content_type: str | None,
        key: str | None, path: str) -> None:
    own = corral.url.removeprefix("http://")
    port = own.rsplit(":", 1)[1]
    headers = {"Host": host.format(host=own, port=port)}
    if origin is not None:
        headers["Origin"] = origin.format(host=own)
    if content_type is not None:
        headers["Content-Type"] = content_type
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    before = _pulls(corral)
    resp = httpx.post(corral.url + path, content=b'{"source": "%s"}' % SOURCE.encode(),
                      headers=headers)
    assert resp.status_code < 500, resp.text
    started = _pulls(corral) > before
    sent_origin = headers.get("Origin")
    # The same origin is the same host and port as the Host header, whatever the scheme.
    same = sent_origin is not None and sent_origin.split("://", 1)[-1] == headers["Host"]
    legit = (headers["Host"] in (own, f"localhost:{port}", "box.corral.test")
             and (sent_origin is None or sent_origin == FRIEND or same)
             and (content_type or "").startswith("application/json")
             and key == ADMIN and path == "/admin/pull")
    assert started == legit, (headers, path, resp.status_code, resp.text[:200])
    if started:
        wait_until(lambda: corral.http.get("/admin/pulls").json()["pulls"][-1]["state"]
                   != "running", timeout=10)


def test_anthropic_clients_send_their_key_as_x_api_key(corral: Corral) -> None:
    """Anthropic's SDK (and Claude Code with ANTHROPIC_API_KEY) authenticate with x-api-key,
    not Authorization: the key is the same key, with the same reach."""
    import anthropic

    client = anthropic.Anthropic(base_url=corral.url, api_key=USER, max_retries=0)
    answer = client.messages.create(model="tiny-a", max_tokens=2,
                                    messages=[{"role": "user", "content": "hi"}])
    assert answer.model == "tiny-a" and answer.type == "message"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=corral.url, api_key="wrong", max_retries=0) \
            .messages.create(model="tiny-a", max_tokens=2,
                             messages=[{"role": "user", "content": "hi"}])
    # A user key says x-api-key as it says Bearer: /v1, never /admin.
    assert httpx.get(corral.url + "/admin/models", headers={"x-api-key": USER}) \
        .status_code == 401
    assert httpx.get(corral.url + "/admin/models", headers={"x-api-key": ADMIN}) \
        .status_code == 200
    # A scheme other than Bearer is no key, with or without an x-api-key beside it.
    assert httpx.get(corral.url + "/v1/models", headers={"Authorization": f"Basic {USER}"}) \
        .status_code == 401


def test_any_origin_without_keys_is_refused_unless_the_operator_says_so(tmp_path: Path) -> None:
    """allowed_origins: ["*"] and no keys: every web page could drive corral. corral check
    (and serve) refuse it, as they refuse an open /admin on a network address."""
    import subprocess
    import sys

    config = tmp_path / "corral.yaml"
    for extra, refused in (("", True), ("admin_open: true\n", False),
                           ("api_keys: [k]\n", False)):
        config.write_text('allowed_origins: ["*"]\n' + extra + "models: {}\n")
        done = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "check",
                               str(config)], capture_output=True, text=True, timeout=120)
        said = done.stdout + done.stderr
        assert (done.returncode != 0) is refused, (extra, said)
        assert ("every web page" in said) is refused, (extra, said)
