"""What the edge gives away and what it survives: header bytes no client library would send (a
key that is not UTF-8, an Origin that is not a URL) are refused, never a 500 with a traceback
in the log; and a web page's refused requests leave no trace an attacker can use: no log
line, event or /admin/requests entry per refusal (a page can send thousands a second), and
no node name (by default the machine's host name) on the 403 a DNS-rebinding page may read.
A remote model on a closed port: nothing starts, nothing is sent anywhere."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import httpx
import pytest

from conftest import Corral, CorralFactory

ADMIN = "leaks-admin"
USER = "leaks-user"
NODE = "node-name-a-page-must-not-read"


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory) -> Corral:
    config = {"api_keys": [USER], "admin_api_keys": [ADMIN], "node_name": NODE,
              "models": {"cloud": {"backend": "remote", "url": "http://127.0.0.1:1/v1"}}}
    return start_corral_module(config, api_key=ADMIN)


def _raw(corral: Corral, head: bytes) -> tuple[int, bytes]:
    """One request as raw bytes (no client library sends these headers): its status, body."""
    parts = urlsplit(corral.url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as conn:
        conn.sendall(head + b"Host: " + parts.netloc.encode() + b"\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def test_key_bytes_that_are_not_utf8_are_no_key_not_a_crash(corral: Corral) -> None:
    for header in (b"Authorization: Bearer \xff\xfe", b"x-api-key: \xe9",
                   b"Authorization: Bearer " + USER.encode() + b"\xe9"):
        for path in (b"/admin/models", b"/v1/models"):
            status, body = _raw(corral, b"GET " + path + b" HTTP/1.1\r\n" + header + b"\r\n")
            assert status == 401 and b"invalid_api_key" in body, (header, path, body)
    # A key of the config that is not ASCII is compared as its UTF-8 bytes.
    assert _raw(corral, b"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer "
                + USER.encode() + b"\r\n")[0] == 200


def test_an_origin_that_is_not_a_url_is_another_origin_not_a_crash(corral: Corral) -> None:
    for origin in (b"http://[", b"http://[::1", b"\xff"):
        status, body = _raw(corral, b"GET /v1/models HTTP/1.1\r\nOrigin: " + origin +
                            b"\r\nAuthorization: Bearer " + USER.encode() + b"\r\n")
        assert status == 403 and b"origin_not_allowed" in body, (origin, body)
        status, body = _raw(corral, b"POST /health HTTP/1.1\r\nOrigin: " + origin +
                            b"\r\nContent-Length: 0\r\n")
        assert status == 403 and b"origin_not_allowed" in body, (origin, body)


def test_a_pages_refused_requests_leave_no_trace_and_name_no_node(corral: Corral) -> None:
    port = urlsplit(corral.url).port
    chat = {"model": "cloud", "messages": [{"role": "user", "content": "hi"}]}
    rebound = f"rebind.example:{port}"  # a page that DNS rebinding made same-origin
    refusals = [
        corral.http.post("/v1/chat/completions", json=chat,
                         headers={"Origin": "http://evil.example"}),
        httpx.post(corral.url + "/v1/chat/completions", content=b"{}",
                   headers={"Host": rebound, "Origin": f"http://{rebound}",
                            "Content-Type": "text/plain"}),
        httpx.get(corral.url + "/v1/models", headers={"Host": rebound}),
        httpx.get(corral.url + "/health", headers={"Host": rebound}),
    ]
    for refused in refusals:
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] in ("origin_not_allowed", "host_not_allowed")
        assert NODE not in str(refused.headers), refused.headers
        assert NODE not in refused.text
        assert "x-request-id" in refused.headers  # still the id to quote
    # Nothing per refusal in the log, the events or the operator's recent requests ...
    assert [e for e in corral.log_events("proxy.request") if e.get("status") == 403] == []
    recent = corral.http.get("/admin/requests").json()["requests"]
    assert [r for r in recent if r["status"] == 403] == [], recent
    # ... but counted, as a 401 is, and the node still named where the edge let it through.
    metrics = corral.http.get("/metrics")
    assert metrics.headers["X-Corral-Node"] == NODE
    assert 'corral_requests_total{endpoint="/v1/chat/completions",model="_unknown",' \
        'status="403"} 2.0' in metrics.text
    assert httpx.get(corral.url + "/health").headers["X-Corral-Node"] == NODE
    assert httpx.get(corral.url + "/v1/models").headers["X-Corral-Node"] == NODE  # a 401


def test_a_pages_requests_without_origin_are_refused_by_sec_fetch_site(corral: Corral) -> None:
    """What Chromium sends for another page's <img>, <script> and no-cors fetch to corral (seen
    on loopback): no Origin, Sec-Fetch-Site `same-site` (another port) or `cross-site`."""
    for site in ("same-site", "cross-site"):
        page = {"Sec-Fetch-Site": site, "Sec-Fetch-Mode": "no-cors"}
        for path in ("/admin/models", "/admin/models/cloud/logs", "/metrics",
                     "/v1/models", "/w/cloud/v1/models"):
            refused = corral.http.get(path, headers=page)
            assert refused.status_code == 403, (site, path, refused.text)
            assert refused.json()["error"]["code"] == "origin_not_allowed"
            assert site in refused.json()["error"]["message"]
        assert corral.http.post("/health", headers=page).status_code == 403
        assert httpx.get(corral.url + "/health", headers=page).status_code == 200
    # corral's own page, the address bar, and clients that are not browsers.
    for own in ("same-origin", "none", None):
        headers = {"Sec-Fetch-Site": own} if own else {}
        assert corral.http.get("/admin/models", headers=headers).status_code == 200, own
