"""Hostile and unlucky requests: malformed bodies, request ids, what 5xx bodies may say, the
error → HTTP table, shutdown, client hang-ups, and who may run which group."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
import pytest

from conftest import tiny_config, wait_until

HI = [{"role": "user", "content": "hi"}]
HEX_ID = re.compile(r"[0-9a-f]{32}")


def assert_openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "code", "param"}, error
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def with_groups(tiny_models, groups: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b"], **overrides)
    config["groups"] = groups
    return config


# -- 1. malformed input: a 400 that names the field, never a 500 ------------------------------

def test_malformed_bodies_are_400_in_the_openai_shape(start_corral, tiny_models):
    corral = start_corral(with_groups(tiny_models, {"core": {"models": ["tiny-a", "tiny-b"]}}))
    post = corral.http.post

    deep = post("/v1/chat/completions", content=b"[" * 100_000,
                headers={"Content-Type": "application/json"})
    assert assert_openai_error(deep, 400)["code"] == "invalid_json"
    nested_object = post("/v1/chat/completions", content=b'{"a":' * 70 + b"1" + b"}" * 70,
                         headers={"Content-Type": "application/json"})
    assert "nested more than" in assert_openai_error(nested_object, 400)["message"]
    huge_int = b'{"model": 1' + b"0" * 5000 + b"}"
    for raw in (b'{"model": "tiny-a", "x": NaN}', b"\xff\xfe{}", huge_int):
        refused = post("/v1/chat/completions", content=raw,
                       headers={"Content-Type": "application/json"})
        assert assert_openai_error(refused, 400)["code"] == "invalid_json"

    not_objects = post("/v1/chain/execute", json={"models": ["tiny-a"], "messages": ["x"]})
    assert assert_openai_error(not_objects, 400)["param"] == "messages[0]"
    bad_part = post("/v1/chain/execute", json={
        "models": ["tiny-a"], "messages": [{"role": "user", "content": [{"text": 5}]}]})
    assert assert_openai_error(bad_part, 400)["param"] == "messages[0].content[0].text"
    bad_number = post("/v1/batch/execute", json={"group": "core", "messages": HI,
                                                 "max_tokens": "many"})
    assert assert_openai_error(bad_number, 400)["param"] == "max_tokens"
    no_group = post("/v1/batch/execute", json={"group": ["core"], "messages": HI})
    assert assert_openai_error(no_group, 400)["param"] == "group"
    bad_template = post("/v1/batch/execute", json={"group": "core", "messages": HI,
                                                   "template": [None]})
    assert assert_openai_error(bad_template, 400)["param"] == "template"
    # llama-server itself answers these with a 500; corral refuses them first.
    bad_role = corral.chat("tiny-a", max_tokens=2, messages=[{"role": 1, "content": "x"}])
    assert assert_openai_error(bad_role, 400)["param"] == "messages[0].role"
    bad_tools = corral.chat("tiny-a", max_tokens=2, tools="not a list")
    assert assert_openai_error(bad_tools, 400)["param"] == "tools"
    compressed = post("/v1/chat/completions", content=b"\x1f\x8b garbage",
                      headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert assert_openai_error(compressed, 400)["code"] == "unsupported_content_encoding"

    assert {m["state"] for m in corral.models().values()} == {"stopped"}  # nothing started
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200


def test_a_childs_own_500_reaches_the_client_as_a_shaped_502(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models))
    # An image for a model without vision: corral refuses it itself, before any start.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    resp = corral.chat("tiny-a", max_tokens=2, messages=[{"role": "user", "content": [image]}])
    assert assert_openai_error(resp, 400)["code"] == "vision_unsupported"
    assert corral.model("tiny-a")["state"] == "stopped"
    # Audio is valid as far as corral checks; a text-only llama-server fails it with HTTP 500.
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    resp = corral.chat("tiny-a", max_tokens=2, messages=[{"role": "user", "content": [audio]}])
    error = assert_openai_error(resp, 502)
    assert error["code"] == "upstream_error" and "answered HTTP 500" in error["message"]
    refused = corral.chat("tiny-a", max_tokens=-5)  # the child's 400 stays a 400, reshaped
    assert assert_openai_error(refused, 400)["param"] is None


# -- 2. request ids --------------------------------------------------------------------------

def test_every_response_carries_a_request_id_that_its_log_lines_carry(start_corral,
                                                                      tiny_models):
    corral = start_corral(tiny_config(tiny_models, api_keys=["k"]), api_key="k")
    kept = corral.http.get("/health", headers={"X-Request-Id": "client.id-1_A"})
    assert kept.headers["x-request-id"] == "client.id-1_A"
    for hostile in ("has space", "x" * 65, "semi;colon", "ünï"):
        given = corral.http.get("/v1/models", headers={"X-Request-Id": hostile.encode()})
        assert HEX_ID.fullmatch(given.headers["x-request-id"]), given.headers
    refused = httpx.get(corral.url + "/v1/models")
    assert refused.status_code == 401 and HEX_ID.fullmatch(refused.headers["x-request-id"])
    missing = corral.http.get("/v1/nothing")
    assert missing.status_code == 404 and HEX_ID.fullmatch(missing.headers["x-request-id"])

    resp = corral.http.post("/v1/chat/completions", headers={"X-Request-Id": "cold-start-1"},
                            json={"model": "tiny-a", "messages": HI, "max_tokens": 2})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "cold-start-1"
    starting = [e for e in corral.log_events("instance.state") if e.get("new") == "starting"]
    assert [e.get("request_id") for e in starting] == ["cold-start-1"]

    with corral.http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "s-1"},
                            json={"model": "tiny-a", "messages": HI, "max_tokens": 2,
                                  "stream": True}) as streamed:
        assert streamed.headers["x-request-id"] == "s-1"
        assert streamed.read().decode().rstrip().endswith("data: [DONE]")


@pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed")
def test_a_failed_start_tells_the_client_its_request_id_and_keeps_the_log_lines(
        start_corral, tiny_models, tmp_path):
    broken = tmp_path / "corrupt.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    config = tiny_config(tiny_models)
    config["models"]["corrupt"] = {"model": str(broken)}
    corral = start_corral(config)

    resp = corral.chat("corrupt")
    error = assert_openai_error(resp, 502)
    rid = resp.headers["x-request-id"]
    assert error["code"] == "model_start_failed"
    assert error["message"].endswith(f"(request id {rid})")
    lines = corral.http.get("/admin/models/corrupt/logs").json()["lines"]
    assert lines, "the admin API keeps the child's output"
    leaked = [line for line in lines if len(line.strip()) > 8 and line.strip() in resp.text]
    assert not leaked and "last log lines" not in resp.text
    # The daemon log has them, under the request's id.
    logged = [e for e in corral.log_events("proxy.start_failed") if e.get("request_id") == rid]
    assert logged and logged[0]["tail"] and set(logged[0]["tail"]) <= set(lines)


# -- 3. the error → HTTP table lives in the proxy ----------------------------------------------

def test_error_to_http_table():
    from corral.proxy.errors import UpstreamFailed, UpstreamTimeout, http_error
    from corral.supervisor import errors

    expected = {
        errors.UnknownModel("x", []): (404, "model_not_found", None),
        errors.QueueFull("x"): (429, "queue_full", "1"),
        errors.QueueTimeout("x"): (503, "queue_timeout", "5"),
        errors.NoCapacity("x"): (503, "no_capacity", "5"),
        errors.ShuttingDown("x"): (503, "shutting_down", "5"),
        errors.StartBackoff("x", retry_after=2.5): (503, "model_start_backoff", "3"),
        errors.StartFailed("x"): (502, "model_start_failed", None),
        errors.StartTimedOut("x"): (504, "model_start_timeout", None),
        UpstreamTimeout("x"): (504, "upstream_timeout", None),
        UpstreamFailed("x"): (502, "upstream_failed", None),
    }
    for exc, (status, code, retry_after) in expected.items():
        resp = http_error(exc)
        assert (resp.status, json.loads(resp.text)["error"]["code"]) == (status, code), exc
        assert resp.headers.get("Retry-After") == retry_after, exc
    assert json.loads(http_error(errors.QueueFull("x")).text)["error"]["type"] == (
        "rate_limit_error")
    # The supervisor speaks meanings only.
    for cls in (errors.SupervisorError, errors.QueueFull, errors.StartFailed):
        assert not {"status", "code", "kind"} & set(vars(cls)), cls
    failed = errors.StartFailed("m exited with code 1 before it was ready: E boom",
                                ["I a", "E boom"])
    assert str(failed) == "m exited with code 1 before it was ready" and failed.tail[-1] == "E boom"


# -- 4. shutdown and hang-ups ------------------------------------------------------------------

@pytest.mark.expect_log("proxy.upstream_failed", "proxy.request_failed")
def test_a_request_stopped_by_shutdown_gets_503_with_retry_after(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models, shutdown_grace=1))
    corral.chat("tiny-a", max_tokens=1)
    outcome: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: outcome.append(corral.chat(
        "tiny-a", max_tokens=7000, ignore_eos=True)))
    worker.start()
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 1)
    corral.proc.send_signal(signal.SIGTERM)
    worker.join(30)
    error = assert_openai_error(outcome[0], 503)
    assert error["code"] == "shutting_down" and "retry-after" in outcome[0].headers
    assert corral.proc.wait(30) == 0


class _Gone:
    """A client connection that is gone (as the relay's ClientWriter sees it): its first write
    raises what aiohttp raises then."""

    prepared = True

    async def prepare(self) -> None:
        return None

    async def write(self, _data: bytes) -> None:
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")


class _Stream:
    """The synthesizer's answer as the relay's client gives it (proxy/child_http)."""

    def __init__(self) -> None:
        self.status = 200
        self.closed = False
        self._lines = [b'data: {"choices": [{"delta": {"content": "t%d"}}]}\n' % n
                       for n in range(3)]

    async def chunk(self) -> bytes:
        return self._lines.pop(0) if self._lines else b""

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        raise AssertionError("a half-read answer must be closed, not pooled")


def test_a_client_hang_up_mid_synthesis_is_not_the_synthesizers_failure():
    """Deterministic stand-ins for the two sockets (the race needs a write landing between
    the transport closing and the handler's cancellation): the synthesizer streams fine, the
    client's socket is gone."""
    from corral.proxy import group_routes
    from corral.proxy.families.streams import FamilyWriter
    from corral.proxy.groups import GroupOutcome
    from corral.supervisor.config import GroupSpec
    from corral.supervisor.port import Broken, Lease

    broke: list[bool] = []
    released: list[bool] = []

    class Owner:
        """The supervisor's side of the lease (the port's LeaseOwner)."""

        def _give_back(self, _lease: Lease) -> None:
            released.append(True)

        def _child_alive(self, _lease: Lease) -> bool:
            return True

        async def _broken(self, _lease: Lease, timed_out: bool) -> Broken:
            broke.append(True)
            return Broken(unresponsive=False, detail=None)

    lease = Lease(Owner(), model="a", instance="a", pid=1, base_url="http://127.0.0.1:9",
                  headers={}, first_byte_timeout=5, idle_timeout=5, ready_since=0.0)

    async def acquire(_model: str, **_kw: Any) -> Any:
        return lease

    upstream = _Stream()

    async def post(*_args: Any, **_kw: Any) -> Any:
        return upstream

    group = GroupSpec(name="council", type="consensus", models=("a",), required_responses=1,
                      member_timeout=5, fallback="strict", replace_with={}, pinned=False,
                      selector="first_ok", judge=None, synthesizer="a", template=None,
                      expose_as_model=True)
    runner = SimpleNamespace(daemon=SimpleNamespace(acquire=acquire, closing=False),
                             pool=SimpleNamespace(post=post),
                             synthesis_body=lambda *_: {"messages": HI},
                             api_of=lambda _model: "chat",
                             body_for=lambda model, body, stream: {**body, "model": model,
                                                                   "stream": stream})
    outcome = GroupOutcome(group, [], 0.0)

    async def run() -> None:
        # The stream's opening: the gone client, the chat writer, a record that notes ttft.
        opened = group_routes._Opening(_Gone(), FamilyWriter(group.name),  # type: ignore[arg-type]
                                       SimpleNamespace(first_bytes=lambda: None))
        await group_routes._stream_synthesis(opened, runner, {}, outcome)  # type: ignore[arg-type]

    with pytest.raises(ConnectionResetError):
        asyncio.run(run())
    assert upstream.closed and released == [True] and broke == []


# -- 5. who may run which group ------------------------------------------------------------------

def test_groups_not_exposed_as_models_need_an_admin_key(start_corral, tiny_models):
    corral = start_corral(with_groups(
        tiny_models, {"open": {"models": ["tiny-a"], "expose_as_model": True},
                      "hidden": {"models": ["tiny-a", "tiny-b"]}},
        api_keys=["user-key"], admin_api_keys=["admin-key"]), api_key="user-key")
    body = {"messages": HI, "max_tokens": 2}

    def post(path: str, key: str, **extra: Any) -> httpx.Response:
        return httpx.post(corral.url + path, json={**body, **extra}, timeout=60,
                          headers={"Authorization": f"Bearer {key}"})

    assert post("/v1/batch/execute", "user-key", group="open").status_code == 200
    for path in ("/v1/batch/execute", "/v1/chain/execute"):
        hidden = assert_openai_error(post(path, "user-key", group="hidden"), 404)
        assert hidden["code"] == "group_not_found"
        assert "open" in hidden["message"] and "'hidden'" in hidden["message"]
        assert "hidden," not in hidden["message"] and "admin key" in hidden["message"]
    assert post("/v1/chain/execute", "user-key", models=["tiny-a"]).status_code == 200
    assert post("/v1/batch/execute", "nobody", group="open").status_code == 401

    by_admin = post("/v1/batch/execute", "admin-key", group="hidden")
    assert by_admin.status_code == 200 and by_admin.json()["complete"]
    assert post("/v1/chain/execute", "admin-key", group="hidden").status_code == 200


def test_tool_call_arguments_nested_past_json_s_recursion_limit_stay_text():
    """A tool call's arguments are a JSON string inside the request (or a member's answer):
    the body's depth check never saw inside it. Read for a Messages side, text nested past
    json's own recursion limit (or past MAX_DEPTH) is carried as text, never a RecursionError
    (a 500 for the client, or a group ended by a hostile member)."""
    from corral.proxy.families.streams import MessagesWriter
    from corral.proxy.families.translate import member_request

    for deep in ("[" * 100_000, "[" * 500 + "]" * 500):
        block = MessagesWriter._tool_use(1, {"function": {"name": "f", "arguments": deep}})
        assert block["input"] == {"arguments": deep}
        request = member_request("messages", {"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": deep}}]}]})
        assert request["messages"][1]["content"][0]["input"] == {"arguments": deep}
    block = MessagesWriter._tool_use(1, {"function": {"name": "f", "arguments": '{"a": [1]}'}})
    assert block["input"] == {"a": [1]}


def test_a_stream_head_nested_past_json_s_recursion_limit_is_not_read():
    """A hostile upstream's first event nested past json's recursion limit (a kilobyte):
    the stream's head reader skips it as it skips broken JSON, instead of a RecursionError
    out of the relay mid-stream."""
    from corral.proxy.families.wire import MESSAGES, RESPONSES

    for wire in (MESSAGES, RESPONSES):
        head = wire.head()
        head.feed(b"data: " + b"[" * 5000 + b"\n\n")
        head.feed(b'data: {"type":"message_start","response":{"id":"r"}}\n\n')
        assert head.done


def test_a_members_tool_input_nested_too_deeply_is_not_an_answer():
    """A hostile Messages member's tool_use input nested hundreds of levels deep (read fine,
    but json.dumps runs out of stack writing it as chat arguments) is that member's error."""
    from corral.proxy.families.answers import NotAnAnswer, member_answer

    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(900):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(NotAnAnswer, match="too deeply"):
        member_answer("messages", {"content": [
            {"type": "tool_use", "id": "i", "name": "f", "input": deep}]})
    shallow = member_answer("messages", {"content": [
        {"type": "tool_use", "id": "i", "name": "f", "input": {"a": [1]}}]})
    assert shallow.tool_calls[0]["function"]["arguments"] == '{"a": [1]}'
