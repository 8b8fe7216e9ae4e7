"""What a hostile or broken upstream can do through the relay, on a real corral with remote
models in front of small servers that misbehave on purpose: an interim answer before the
real one (one client's answer must never reach another), and a POST the upstream took and
then dropped (never sent twice: it may have been done, and paid for)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_upstream import requests
from raw_server import RawServer

from conftest import Corral, CorralFactory, tiny_config


class Upstream(RawServer):
    """`behaviour` answers each request (its body) with the bytes to send, or None to close
    the connection without a byte."""

    def __init__(self, behaviour: Any):
        self.behaviour = behaviour
        self.requests: list[bytes] = []
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        for _method, _path, body in requests(conn):
            self.requests.append(body)
            for part in self.behaviour(body) or ():
                if part is None:
                    return  # close without (more of) an answer
                try:
                    conn.sendall(part)
                except OSError:
                    return  # corral hung up


def _chat(content: str) -> bytes:
    import json
    body = json.dumps({"id": "x", "object": "chat.completion", "model": "far", "choices": [
        {"index": 0, "finish_reason": "stop",
         "message": {"role": "assistant", "content": content}}]}).encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _hints_first(body: bytes) -> list[bytes | None]:
    who = "A" if b"for A" in body else "B"
    return [b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n",
            _chat(f"answer for {who}")]


def _took_it_and_left(_body: bytes) -> list[bytes | None]:
    return [None]


def _endless(_body: bytes) -> Iterator[bytes | None]:
    """A 200 with no length that never ends (until corral hangs up)."""
    yield b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n["
    chunk = b'"' + b"x" * 65536 + b'",'
    for _ in range(10_000):  # 640 MB at most: corral stops reading long before
        yield chunk


@pytest.fixture(scope="module")
def upstreams() -> Iterator[dict[str, Upstream]]:
    made = {"hints": Upstream(_hints_first), "drops": Upstream(_took_it_and_left),
            "paid": Upstream(lambda _body: [_chat("done")]), "endless": Upstream(_endless)}
    yield made
    for upstream in made.values():
        upstream.close()


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path],
           upstreams: dict[str, Upstream]) -> Corral:
    config = tiny_config(tiny_models, ["tiny-a"])
    for name, upstream in upstreams.items():
        config["models"][name] = {"backend": "remote",
                                  "url": f"http://127.0.0.1:{upstream.port}"}
    config["models"]["paid"]["paths"] = ["/v1/tokenize"]  # what the operator adds
    config["max_answer_mb"] = 2
    config["groups"] = {"pair": {"type": "parallel", "models": ["drops", "paid"]},
                        "big": {"type": "parallel", "models": ["endless", "paid"]}}
    config["api_keys"] = ["user-key"]
    config["admin_api_keys"] = ["admin-key"]
    corral = start_corral_module(config, api_key="admin-key")
    corral.expect("proxy.request_failed", "proxy.upstream_failed", "proxy.group_failed")
    return corral


def test_an_interim_answer_never_hands_one_clients_answer_to_another(
        corral: Corral, upstreams: dict[str, Upstream]) -> None:
    for _ in range(3):
        for who in ("A", "B"):
            resp = corral.chat("hints", content=f"for {who}")
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] == f"answer for {who}"
            assert "link" not in resp.headers  # the interim's headers are not the answer's


def test_a_post_the_upstream_took_and_dropped_is_sent_once(
        corral: Corral, upstreams: dict[str, Upstream]) -> None:
    drops = upstreams["drops"]
    before = len(drops.requests)
    resp = corral.chat("drops", content="do the paid thing once")
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["code"] == "upstream_failed", resp.text
    assert len(drops.requests) - before == 1, "the POST was sent again"


@pytest.mark.parametrize("key", ["user-key", "admin-key"])
def test_provider_paths_are_closed_to_every_key(corral: Corral, upstreams: dict[str, Upstream],
                                                key: str) -> None:
    """A user key (and an admin key: it widens nothing on /v1) naming a remote model on a
    provider's path that is not an inference one: 404, and the remote sees nothing."""
    paid = upstreams["paid"]
    before = len(paid.requests)
    for path in ("/v1/fine_tuning/jobs", "/v1/assistants", "/v1/files", "/v1/model/load",
                 "/v1/lora/load", "/v1/load_lora_adapter"):
        resp = corral.http.post(path, json={"model": "paid", "training_file": "x"},
                                headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 404, (path, resp.text)
        assert resp.json()["error"]["code"] == "unknown_path", resp.text
    assert len(paid.requests) == before
    # What the backend serves, and what the operator added, do reach it.
    for path in ("/v1/chat/completions", "/v1/tokenize"):
        resp = corral.http.post(path, json={"model": "paid", "messages": [
            {"role": "user", "content": "hi"}]}, headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200, (path, resp.text)
    assert len(paid.requests) == before + 2


def test_an_unknown_path_to_a_stopped_model_starts_nothing(corral: Corral) -> None:
    resp = corral.http.post("/v1/fine_tuning/jobs", json={"model": "tiny-a"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_path"
    assert corral.model("tiny-a")["state"] == "stopped"


def test_a_whole_answer_past_max_answer_mb_is_a_502_not_a_daemon_full_of_it(
        corral: Corral) -> None:
    resp = corral.chat("endless")
    assert resp.status_code == 502, resp.text[:300]
    assert resp.json()["error"]["code"] == "upstream_failed", resp.text
    assert corral.chat("paid").status_code == 200  # and corral serves on


def test_a_groups_call_to_a_remote_that_dropped_it_is_not_sent_again(
        corral: Corral, upstreams: dict[str, Upstream]) -> None:
    drops = upstreams["drops"]
    before = len(drops.requests)
    resp = corral.http.post("/v1/batch/execute", json={
        "group": "pair", "messages": [{"role": "user", "content": "once"}], "max_tokens": 4})
    assert resp.status_code in (200, 502), resp.text
    assert len(drops.requests) - before == 1, "the group's POST was sent again"


def test_a_groups_member_past_max_answer_mb_fails_the_member_not_the_daemon(
        corral: Corral) -> None:
    resp = corral.http.post("/v1/batch/execute", json={
        "group": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert resp.status_code == 502, resp.text[:300]  # a strict group: one member failed
    members = {m["model"]: m for m in resp.json()["group"]["responses"]}
    assert members["endless"]["status"] == "error"
    assert "max_answer_mb" in members["endless"]["error"], members["endless"]
    assert members["paid"]["status"] == "ok"
