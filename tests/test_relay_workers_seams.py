"""Relay workers at their seams with the rest of corral: what a worker serves, or forwards
to the daemon, behaves as the daemon alone does (tests/test_relay_workers.py has the workers'
own machinery)."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from conftest import CorralFactory, sse_lines, tiny_config, wait_until


def _config(tiny_models: dict[str, Path], **overrides: Any) -> dict[str, Any]:
    return tiny_config(tiny_models, ["tiny-a", "tiny-b"], relay_workers=2, **overrides)


def test_sigterm_ends_an_event_stream_forwarded_by_a_worker_cleanly(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    corral = start_corral(_config(tiny_models))
    wait_until(lambda: len(corral.log_events("relay_worker.ready")) == 2, timeout=30)
    with httpx.Client(base_url=corral.url, timeout=30) as http, \
            http.stream("GET", "/admin/events") as resp:
        assert resp.status_code == 200
        rest = []
        for line in sse_lines(resp):
            if line and not rest:
                corral.proc.send_signal(signal.SIGTERM)
            rest.append(line)
    # The daemon's last words reach the client whole through the worker, then the end.
    assert "event: stopped" in rest, rest
    assert corral.proc.wait(30) == 0


def test_a_stalled_client_of_a_forwarded_stream_is_counted_once_under_its_model(
        start_corral: CorralFactory, smol_model: Path) -> None:
    """A cold model's request goes to the daemon whole (its start, its progress) and the
    worker writes the daemon's answer to the client: a client that stops reading is cut off
    as without workers, named and counted under its model, once."""
    corral = start_corral({
        "client_write_timeout": 2, "relay_workers": 2,
        "defaults": {"ttl": 300, "stop_grace": 5, "queue_timeout": 30},
        "models": {"smol": {"model": str(smol_model), "ctx": 4096, "parallel": 1}},
    })
    wait_until(lambda: len(corral.log_events("relay_worker.ready")) == 2, timeout=30)
    body = json.dumps({
        "model": "smol", "stream": True, "max_tokens": 3000, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 20,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
    }).encode()
    address = urlsplit(corral.url)
    assert address.hostname and address.port
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((address.hostname, address.port))
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\n"
                     b"Content-Type: application/json\r\nX-Request-Id: stuck-cold\r\n"
                     b"Content-Length: %d\r\n\r\n%s"
                     % (address.netloc.encode(), len(body), body))
        wait_until(lambda: corral.model("smol")["in_flight"] == 1, timeout=60)
        wait_until(lambda: corral.model("smol")["in_flight"] == 0, timeout=120, interval=0.2)
        wait_until(lambda: [e for e in corral.log_events("proxy.request")
                            if e.get("request_id") == "stuck-cold"], timeout=10)
        stalled = corral.log_events("proxy.client_stalled")
        assert [(e["model"], e["request_id"]) for e in stalled] == [("smol", "stuck-cold")]
        metrics = corral.http.get("/metrics").text
        timeouts = [m for m in metrics.splitlines()
                    if m.startswith("corral_client_write_timeouts_total{")]
        assert timeouts == ['corral_client_write_timeouts_total{model="smol"} 1.0'], timeouts
        accounted = [e for e in corral.log_events("proxy.request")
                     if e.get("request_id") == "stuck-cold"]
        assert [e["status"] for e in accounted] == [499], accounted
    finally:
        sock.close()
