"""The per-model mount, /w/<quoted name>/..., that lets a router taking one model per worker URL
(smg) see a corral node as one worker per model (proxy/mount.py, docs/fleet.md): each route's
answer and shape, the top level's relay behind it (streams, model checks, accounting), the
same keys and origin rules as /v1, and X-Corral-Node on every answer. Command children of
tests/family_upstream.py (a stdlib stub that logs what it gets): no real model is needed."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import openai
import pytest
import yaml

from conftest import Corral, wait_until

STUB = Path(__file__).parent / "family_upstream.py"
KEY = "k-fleet"
NODE = "node-7.test"
SLASHED = "org/fam:1"  # a name with "/" and ":", as Hugging Face ids and tags have
SLASHED_BASE = "/w/" + quote(SLASHED, safe="")
# A failing start is what the broken model is for.
pytestmark = pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed")


def stub(log: Path, **extra: Any) -> dict[str, Any]:
    return {"backend": "command", "health": "none", "memory_mb": 10,
            "command": [sys.executable, "-S", str(STUB), "--port", "${PORT}", "--log", str(log)],
            **extra}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mount-logs")


@pytest.fixture(scope="module")
def node(start_corral_module, logs: Path) -> Corral:
    config = {
        "api_keys": [KEY], "node_name": NODE, "shutdown_grace": 0.2,
        "models": {
            SLASHED: stub(logs / "slashed.jsonl", aliases=["fam"]),
            "plain": stub(logs / "plain.jsonl"),
            "cold": stub(logs / "cold.jsonl"),  # never asked: stays stopped
            "broken": {"backend": "command", "health": "none", "memory_mb": 10,
                       "start_backoff": 60, "command": ["/bin/false", "${PORT}"]},
        },
        "groups": {"duo": {"type": "parallel", "models": [SLASHED, "plain"],
                           "expose_as_model": True}},
    }
    return start_corral_module(config, api_key=KEY)


def sent(log: Path) -> list[dict[str, Any]]:
    """What the stub got: one {"path", "body"} per request."""
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def chat(node: Corral, base: str, **body: Any) -> httpx.Response:
    return node.http.post(base + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], **body})


# -- the reads -----------------------------------------------------------------------------------

def test_models_lists_that_model_only_in_the_top_level_shape(node: Corral) -> None:
    top = {m["id"]: m for m in node.http.get("/v1/models").json()["data"]}
    for name in (SLASHED, "plain", "cold", "duo"):
        answer = node.http.get("/w/" + quote(name, safe="") + "/v1/models")
        assert answer.status_code == 200
        listing = answer.json()
        assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == [name]
        entry = listing["data"][0]
        assert set(entry) == set(top[name]) and entry["object"] == "model"


def test_health_of_a_configured_model_group_and_unknown_name(node: Corral) -> None:
    answer = node.http.get(SLASHED_BASE + "/health")
    assert answer.status_code == 200
    assert answer.json() == {"status": "ok", "model": SLASHED,
                             "state": node.models()[SLASHED]["state"]}
    assert answer.headers["X-Corral-Node"] == NODE
    group = node.http.get("/w/duo/health")
    assert group.status_code == 200 and group.json()["state"] == "group"
    unknown = node.http.get("/w/nothing-here/health")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert unknown.headers["X-Corral-Node"] == NODE


def test_a_failed_model_is_503_where_a_ready_one_is_200(node: Corral) -> None:
    started = chat(node, "/w/broken")
    assert started.status_code == 502
    assert started.json()["error"]["code"] == "model_start_failed"
    failed = node.http.get("/w/broken/health")
    assert failed.status_code == 503
    assert failed.json()["error"]["code"] == "model_failed"
    assert chat(node, "/w/plain").status_code == 200
    assert node.http.get("/w/plain/health").json()["state"] == "ready"


def test_loads_put_a_cold_start_penalty_on_a_model_not_ready(node: Corral) -> None:
    assert chat(node, SLASHED_BASE).status_code == 200
    warm = node.http.get(SLASHED_BASE + "/v1/loads").json()
    cold = node.http.get("/w/cold/v1/loads").json()
    for loads in (warm, cold):  # smg's WorkerLoadResponse: one rank
        assert loads["dp_rank_count"] == 1 and len(loads["loads"]) == 1
        assert isinstance(loads["timestamp"], str)
        rank = loads["loads"][0]
        assert {"dp_rank", "num_running_reqs", "num_waiting_reqs", "token_usage"} <= set(rank)
    warm_rank, cold_rank = warm["loads"][0], cold["loads"][0]
    assert warm_rank["num_waiting_reqs"] == 0 and warm_rank["token_usage"] == 0.0
    assert warm_rank["num_waiting_uncached_tokens"] == 0
    assert warm["corral"] == {"model": SLASHED, "ready": True, "in_flight": 0, "queued": 0,
                              "cold_penalty_tokens": 0}
    # smg's least_load reads queued tokens first: 1000 requests at its default 1024 tokens
    # each, far above any queue. Its overload veto's signals (waiting requests, token usage)
    # stay clear: a cold node is a worse choice, never one left out.
    assert cold_rank["num_waiting_uncached_tokens"] >= 1000 * 1024
    assert cold_rank["num_waiting_reqs"] == 0 and cold_rank["token_usage"] == 0.0
    assert cold["corral"]["ready"] is False
    assert node.http.get(SLASHED_BASE + "/get_load").json() == {"load": 0}
    assert node.http.get("/w/cold/get_load").json()["load"] >= 1000
    # Reading loads starts nothing.
    assert node.models()["cold"]["state"] == "stopped"


def test_loads_count_requests_in_flight_and_queued(node: Corral) -> None:
    assert chat(node, "/w/plain").status_code == 200  # ready, one slot
    body = json.dumps({"messages": [{"role": "user", "content": "hostile:endless"}]}).encode()
    host, port = node.url.removeprefix("http://").split(":")
    hung = []
    for _ in range(2):  # the first takes the slot and never gets an answer; the second queues
        conn = socket.create_connection((host, int(port)), timeout=10)
        conn.sendall(b"POST /w/plain/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        hung.append(conn)

    def rank() -> dict[str, Any]:
        loads: dict[str, Any] = node.http.get("/w/plain/v1/loads").json()["loads"][0]
        return loads

    try:
        wait_until(lambda: (rank()["num_running_reqs"], rank()["num_waiting_reqs"]) == (1, 1))
        assert rank()["num_waiting_uncached_tokens"] == 0  # warm: smg counts the requests
        assert node.http.get("/w/plain/get_load").json() == {"load": 2}
    finally:
        for conn in hung:  # the clients hang up: corral drops both upstream requests
            conn.close()
    wait_until(lambda: node.http.get("/w/plain/get_load").json() == {"load": 0})


# -- requests through the mount -----------------------------------------------------------------

def test_a_body_without_model_is_served_as_the_mounts(node: Corral, logs: Path) -> None:
    before = len(sent(logs / "slashed.jsonl"))
    answer = chat(node, SLASHED_BASE)
    assert answer.status_code == 200 and answer.json()["model"] == SLASHED
    relayed = sent(logs / "slashed.jsonl")[before:]
    assert [r["body"]["model"] for r in relayed] == [SLASHED]
    assert relayed[0]["path"] == "/v1/chat/completions"


def test_an_alias_or_the_name_pass_another_model_is_404(node: Corral) -> None:
    assert chat(node, SLASHED_BASE, model="fam").status_code == 200
    assert chat(node, SLASHED_BASE, model=SLASHED).status_code == 200
    wrong = chat(node, SLASHED_BASE, model="plain")
    assert wrong.status_code == 404
    assert wrong.json()["error"]["code"] == "model_not_found"
    assert wrong.json()["error"]["param"] == "model"
    assert wrong.headers["X-Corral-Node"] == NODE
    not_a_name = chat(node, SLASHED_BASE, model=5)  # the top level's 400, as there
    assert not_a_name.status_code == 400
    assert not_a_name.json()["error"]["code"] == node.chat(5).json()["error"]["code"]
    unknown_mount = chat(node, "/w/nothing-here", model="plain")
    assert unknown_mount.status_code == 404
    assert unknown_mount.json()["error"]["code"] == "model_not_found"


def test_the_openai_sdk_streams_through_the_mount(node: Corral) -> None:
    client = openai.OpenAI(base_url=node.url + SLASHED_BASE + "/v1", api_key=KEY,
                           max_retries=0)
    with client.chat.completions.with_streaming_response.create(
            model="fam", stream=True, messages=[{"role": "user", "content": "hi"}]) as raw:
        assert raw.headers["X-Corral-Node"] == NODE
        assert raw.headers["Content-Type"].startswith("text/event-stream")
        text = "".join(chunk.choices[0].delta.content or ""
                       for chunk in raw.parse() if chunk.choices)
    assert text == "fake stream "
    whole = client.chat.completions.create(model=SLASHED,
                                           messages=[{"role": "user", "content": "hi"}])
    assert whole.choices[0].message.content == "fake answer"


def test_a_group_mount_runs_the_group(node: Corral) -> None:
    answer = chat(node, "/w/duo")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "duo"
    assert chat(node, "/w/duo", model=SLASHED).json()["error"]["code"] == "model_not_found"


def test_methods_and_paths_like_the_top_level(node: Corral) -> None:
    posted = node.http.get(SLASHED_BASE + "/v1/chat/completions")
    assert posted.status_code == 405 and posted.headers["Allow"] == "POST"
    for read in ("/health", "/v1/models", "/v1/loads", "/get_load"):
        assert node.http.post(SLASHED_BASE + read, json={}).status_code == 405
    assert node.http.get(SLASHED_BASE + "/v1/nothing").status_code == 404
    not_served = node.http.post(SLASHED_BASE + "/v1/fine_tuning/jobs", json={})
    assert not_served.status_code == 404
    assert not_served.json()["error"]["code"] == "unknown_path"
    dots = node.http.post(SLASHED_BASE + "/v1/%2E%2E/slots", json={})
    assert dots.status_code == 404


def test_mount_requests_are_counted_like_the_top_levels(node: Corral) -> None:
    def counted() -> float:
        for line in node.http.get("/metrics").text.splitlines():
            if line.startswith("corral_requests_total{") and 'model="plain"' in line \
                    and 'endpoint="/v1/chat/completions"' in line and 'status="200"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = counted()
    assert chat(node, "/w/plain").status_code == 200
    assert node.chat("plain").status_code == 200
    wait_until(lambda: counted() == before + 2)
    recent = node.http.get("/admin/requests", params={"limit": 2}).json()["requests"]
    assert [(r["endpoint"], r["model"]) for r in recent] == [("/v1/chat/completions",
                                                            "plain")] * 2


# -- the edge -------------------------------------------------------------------------------------

def test_keys_are_required_like_v1_and_health_is_open_like_health(node: Corral) -> None:
    bare = httpx.Client(base_url=node.url, timeout=10)
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/loads"),
                         ("GET", "/get_load"), ("POST", "/v1/chat/completions")):
        refused = bare.request(method, SLASHED_BASE + path, json={})
        assert refused.status_code == 401, path
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.headers["X-Corral-Node"] == NODE
        wrong = bare.request(method, SLASHED_BASE + path, json={},
                             headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
    assert bare.get(SLASHED_BASE + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert node.http.get(SLASHED_BASE + "/v1/loads").status_code == 200
    # smg checks a worker's health at its registration without the key, as it may /health.
    assert bare.get("/health").status_code == 200
    assert bare.get(SLASHED_BASE + "/health").status_code == 200


def test_health_without_a_key_is_the_nodes_liveness_whatever_the_name(node: Corral) -> None:
    """Without the key, a mount's health must not tell a configured name from an unknown or a
    failed one (nor list the node's models in a 404): it answers what /health answers."""
    bare = httpx.Client(base_url=node.url, timeout=10)
    keyed = node.http.get("/w/nothing-here/health")
    assert keyed.status_code == 404  # with the key: per model, as before
    top = bare.get("/health")
    for name in (SLASHED, "plain", "broken", "nothing-here", "..", "duo"):
        for headers in ({}, {"Authorization": "Bearer nope"}):
            answer = bare.get("/w/" + quote(name, safe="") + "/health", headers=headers)
            assert (answer.status_code, answer.json().keys()) == \
                (top.status_code, top.json().keys()), name
            assert "plain" not in answer.text and "available" not in answer.text
            assert answer.headers["X-Corral-Node"] == NODE


def test_another_origin_is_refused_like_v1(node: Corral) -> None:
    page = {"Origin": "http://evil.example:9", "Content-Type": "application/json"}
    for method, path in (("GET", "/health"), ("GET", "/v1/loads"),
                         ("POST", "/v1/chat/completions")):
        refused = node.http.request(method, SLASHED_BASE + path, headers=page,
                                    content=b'{"messages": []}')
        assert refused.status_code == 403, path
        assert refused.json()["error"]["code"] == "origin_not_allowed"
    top = node.http.post("/v1/chat/completions", headers=page, content=b"{}")
    assert top.status_code == 403


def test_admin_models_says_the_node(node: Corral) -> None:
    answer = node.http.get("/admin/models")
    assert answer.json()["node"] == NODE and answer.headers["X-Corral-Node"] == NODE


# -- node_name -------------------------------------------------------------------------------------

def test_node_name_defaults_to_the_host_name_and_a_reload_applies_it(start_corral,
                                                                      logs: Path) -> None:
    config: dict[str, Any] = {"models": {"plain": stub(logs / "other.jsonl")}}
    node = start_corral(config)
    assert node.http.get("/health").headers["X-Corral-Node"] == socket.gethostname()
    assert node.http.get("/admin/models").json()["node"] == socket.gethostname()
    node.config_path.write_text(yaml.safe_dump({**config, "node_name": "renamed"}))
    reloaded = node.http.post("/admin/reload")
    assert reloaded.status_code == 200, reloaded.text
    wait_until(lambda: node.http.get("/w/plain/health").headers["X-Corral-Node"] == "renamed")
    assert node.http.get("/admin/models").json()["node"] == "renamed"


def test_a_node_name_a_header_cannot_carry_is_refused(tmp_path: Path) -> None:
    from corral.supervisor.config import parse_config
    with pytest.raises(Exception, match="node_name"):
        parse_config("node_name: \"a b\\r\\nX-Evil: 1\"\n", source=tmp_path / "c.yaml")
