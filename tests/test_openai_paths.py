"""Every OpenAI-style path a child serves, each model's capabilities, and llama.cpp router
mode's management API as Open WebUI's llama.cpp connection uses it (GET /models with
`status.value`, POST /models/load and /models/unload with {"model": ...})."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Corral, CorralFactory, tiny_config, wait_until

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Corral:
    folder = tmp_path_factory.mktemp("paths")
    broken = folder / "broken.gguf"
    broken.write_bytes(b"GGUF but not a model")
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b"], policy={"max_loaded": 4},
                         api_keys=["user-key"])
    models = config["models"]
    models["tiny-a"]["aliases"] = ["alpha"]
    # An embeddings model (llama-server --embeddings answers nothing else).
    models["emb"] = {**models["tiny-b"], "embeddings": True, "args": ["--pooling", "mean"]}
    # Said to see images, though its child has no projector: what corral relays is what the
    # child gets, and the child's own refusal shows it arrived.
    models["seer"] = {**models["tiny-b"], "capabilities": ["chat", "vision"]}
    models["broken"] = {"model": str(broken), "start_backoff": 0}
    config["groups"] = {"pair": {"type": "parallel", "models": ["tiny-a", "tiny-b"],
                                 "expose_as_model": True}}
    return start_corral_module(config, api_key="user-key")


def post(corral: Corral, path: str, **body: Any) -> httpx.Response:
    return corral.http.post(path, json=body)


def test_responses_and_anthropic_messages_reach_the_child(corral):
    # Not a fixed list of three: whatever the child implements, by the model's name or alias.
    responses = post(corral, "/v1/responses", model="alpha", input="hi", max_output_tokens=3)
    assert responses.status_code == 200, responses.text
    assert responses.json()["object"] == "response"
    messages = post(corral, "/v1/messages", model="tiny-a", messages=HI, max_tokens=3)
    assert messages.status_code == 200, messages.text
    assert messages.json()["type"] == "message" and messages.json()["role"] == "assistant"


def test_a_path_the_child_lacks_is_its_404_in_the_openai_shape(corral):
    resp = post(corral, "/v1/no/such/thing", model="tiny-a")
    assert resp.status_code == 404
    assert set(resp.json()["error"]) == {"message", "type", "code", "param"}
    # A GET under /v1 that is not corral's own: 404, not 405.
    assert corral.http.get("/v1/no/such/thing").status_code == 404


def raw_post(corral: Corral, target: str, body: bytes) -> tuple[int, bytes]:
    """A POST with the request target exactly as given: HTTP clients normalise dot segments
    before sending, an attacker's client does not."""
    host, port = corral.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer user-key\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest


@pytest.mark.parametrize("target", [
    "/v1/../tokenize", "/v1/..%2Ftokenize", "/v1/x/%2e%2e/%2e%2e/tokenize",
    "/v1/%252e%252e/tokenize", "/v1/..%2Fslots%2F0%3Faction=erase", "/v1/..%2Fprops",
    "/v1/..%2Fv1%2Fchat%2Fcompletions", "/v1//chat/completions", "/v1/chat/completions%3Fx=1",
    "/v1/load_lora_adapter",
])
def test_a_path_that_would_reach_another_endpoint_of_the_child_never_leaves(corral, target):
    status, body = raw_post(corral, target, json.dumps(
        {"model": "tiny-b", "messages": HI, "content": "hi"}).encode())
    # Not relayed: the child's /tokenize, /slots or /props answer 200 (or 501) to these.
    assert status in (400, 404), (status, body[:300])
    assert corral.model("tiny-b")["state"] == "stopped"  # nothing started for it


def test_odd_content_shapes_on_every_chat_path_are_400s_or_answers_never_500s(corral):
    odd = [{"role": "user", "content": [{"type": ["image_url"]}, {"type": {"a": 1}}, 5]}]
    for path, body in (("/v1/responses", {"input": odd}), ("/v1/messages", {"messages": odd}),
                       ("/v1/responses", {"input": "x", "instructions": 5})):
        resp = post(corral, path, model="tiny-a", max_tokens=2, max_output_tokens=2, **body)
        assert resp.status_code < 500 or resp.json()["error"]["code"] == "upstream_error", (
            path, resp.text)
    # An image in the Responses and Messages shapes counts as one too.
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]
    refused = post(corral, "/v1/responses", model="tiny-b", input=image)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "vision_unsupported"


def test_capabilities_are_listed_and_enforced_before_anything_starts(corral):
    listed = {m["id"]: m for m in corral.http.get("/v1/models").json()["data"]}
    assert listed["tiny-a"]["capabilities"] == ["chat", "completion"]
    assert listed["emb"]["capabilities"] == ["embeddings"]
    assert listed["seer"]["capabilities"] == ["chat", "vision"]
    assert listed["pair"]["capabilities"] == ["chat"]
    # The GGUF file's own facts (read in the background after start): the tiny llama written
    # by tests/tinymodel.py.
    meta = wait_until(lambda: {m["id"]: m for m in corral.http.get("/v1/models").json()[
        "data"]}["tiny-a"].get("meta"), timeout=10)
    assert meta["architecture"] == "llama" and meta["context_length"] == 32768
    assert meta["parameters"] > 0 and meta["size_bytes"] == Path(
        corral.models()["tiny-a"]["model_path"]).stat().st_size
    assert meta["mmproj"] is False

    chat = post(corral, "/v1/chat/completions", model="emb", messages=HI)
    assert chat.status_code == 400
    assert chat.json()["error"]["code"] == "unsupported_capability"
    rerank = post(corral, "/v1/rerank", model="tiny-a", query="q", documents=["d"])
    assert rerank.status_code == 400 and "rerank" in rerank.json()["error"]["message"]
    embed = post(corral, "/v1/embeddings", model="tiny-a", input="x")
    assert embed.status_code == 400 and embed.json()["error"]["code"] == "embeddings_disabled"
    image = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    vision = post(corral, "/v1/chat/completions", model="tiny-b", messages=image)
    assert vision.status_code == 400 and vision.json()["error"]["code"] == "vision_unsupported"
    states = {m["name"]: m["state"] for m in corral.http.get("/admin/models").json()["models"]}
    assert states["emb"] == states["tiny-b"] == "stopped"  # refused, nothing started for it
    # The embeddings model does answer what it is for.
    vectors = post(corral, "/v1/embeddings", model="emb", input=["a", "b"])
    assert vectors.status_code == 200 and len(vectors.json()["data"]) == 2


def test_image_content_is_relayed_unchanged_to_a_model_that_sees(corral):
    image = [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    resp = post(corral, "/v1/chat/completions", model="seer", messages=image, max_tokens=2)
    # The child got the image part as sent: its refusal (no projector) is about the image.
    assert resp.status_code == 502, resp.text
    assert "image" in resp.json()["error"]["message"].lower()


# -- Open WebUI / llama.cpp router -------------------------------------------------------------

def router_models(corral: Corral) -> dict[str, dict[str, Any]]:
    resp = corral.http.get("/models")
    assert resp.status_code == 200
    return {m["id"]: m for m in resp.json()["data"]}


def test_models_lists_router_status_and_load_unload_change_it(corral):
    unloaded = router_models(corral)["tiny-b"]
    if unloaded["status"]["value"] != "unloaded":
        corral.http.post("/admin/models/tiny-b/unload?force=1")
        unloaded = router_models(corral)["tiny-b"]
    assert unloaded["status"] == {"value": "unloaded"} and unloaded["loaded"] is False
    assert unloaded["object"] == "model" and unloaded["owned_by"] == "corral"

    loaded = corral.http.post("/models/load", json={"model": "tiny-b"})
    assert loaded.status_code == 200 and loaded.json() == {"success": True}
    assert wait_until(lambda: router_models(corral)["tiny-b"]["status"]["value"] == "loaded",
                      timeout=15)
    # The same shape in /v1/models, where Open WebUI reads it too.
    v1 = {m["id"]: m for m in corral.http.get("/v1/models").json()["data"]}
    assert v1["tiny-b"]["status"] == {"value": "loaded"} and v1["tiny-b"]["state"] == "ready"

    gone = corral.http.post("/models/unload", json={"model": "tiny-b"})
    assert gone.status_code == 200 and gone.json() == {"success": True}
    assert wait_until(lambda: router_models(corral)["tiny-b"]["status"]["value"] == "unloaded",
                      timeout=15)


@pytest.mark.expect_log("daemon.load_failed")
def test_a_group_loads_its_members_and_a_failed_model_says_so(corral):
    assert corral.http.post("/models/load", json={"model": "pair"}).json() == {"success": True}
    assert wait_until(lambda: router_models(corral)["pair"]["status"]["value"] == "loaded",
                      timeout=15)
    assert corral.http.post("/models/load", json={"model": "broken"}).status_code == 200
    assert wait_until(lambda: router_models(corral)["broken"]["status"].get("failed"),
                      timeout=15)
    status = router_models(corral)["broken"]["status"]
    # llama.cpp's shape for a model whose load failed.
    assert status == {"value": "unloaded", "failed": True}
    # Why is the operator's to read (it may quote the child's log).
    assert corral.model("broken")["last_error"]


def test_router_endpoints_refuse_bad_input_in_the_openai_shape(corral):
    unknown = corral.http.post("/models/load", json={"model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    missing = corral.http.post("/models/unload", json={})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    garbage = corral.http.post("/models/load", content=b"{nope",
                               headers={"Content-Type": "application/json"})
    assert garbage.status_code == 400
    # Open WebUI calls them with its API key, like /v1; without one they are closed.
    assert httpx.get(corral.url + "/models").status_code == 401
    assert httpx.post(corral.url + "/models/load", json={"model": "tiny-a"}).status_code == 401
    # /metrics says what runs and what it holds: the admin keys' (here the API keys', as no
    # admin keys are set), like /admin.
    assert httpx.get(corral.url + "/metrics").status_code == 401
    assert corral.http.get("/metrics").status_code == 200


@pytest.mark.parametrize("method, path, allow", [
    ("POST", "/v1/models", "GET, HEAD"),
    ("DELETE", "/v1/models", "GET, HEAD"),
    ("POST", "/v1/models/tiny-a", "GET, HEAD"),
    ("PUT", "/v1/models/tiny-a", "GET, HEAD"),
    ("GET", "/v1/chat/completions", "POST"),
    ("PUT", "/v1/embeddings", "POST"),
    ("GET", "/v1/chain/execute", "POST"),
    ("DELETE", "/v1/batch/execute", "POST"),
    ("GET", "/models/load", "POST"),
    ("DELETE", "/models", "GET, HEAD"),
])
@pytest.mark.parametrize("body", [b"", b"{nope", b'{"model": "tiny-a", "messages": []}'])
def test_a_wrong_method_on_an_openai_path_is_a_405_naming_the_right_ones(
        corral, method, path, allow, body):
    """Whatever the body (none, not JSON, or one naming a model): nothing is parsed, relayed
    or started."""
    resp = corral.http.request(method, path, content=body)
    assert resp.status_code == 405, (resp.status_code, resp.text)
    assert set(resp.headers["Allow"].replace(" ", "").split(",")) == set(allow.split(", "))
    error = resp.json()["error"]
    assert error["code"] == "method_not_allowed" and method in error["message"], error
    assert set(error) == {"message", "type", "code", "param"}
    assert corral.model("tiny-a")["state"] in ("stopped", "ready")
    # An unknown path stays a 404 under any method but POST (POST relays whatever names a
    # model, to the child's own endpoints).
    if method != "POST":
        assert corral.http.request(method, "/v1/no/such/thing").status_code == 404
