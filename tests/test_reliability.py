"""Supervisor correctness under races and bookkeeping faults, against real children: minimal
child environments, a failing spawn step, cold starts that must not queue behind an unrelated
eviction, groups whose members overlap, and TTL stops racing requests."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import tiny_config, wait_until


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(): v.decode() for k, v in pairs}


def test_children_get_a_minimal_environment(start_corral, tiny_models, monkeypatch):
    # The daemon's own secrets must not reach a child any local user can inspect.
    monkeypatch.setenv("OPENAI_API_KEY", "sk-daemon-secret")
    monkeypatch.setenv("CORRAL_TEST_SECRET", "do-not-leak")
    config = tiny_config(tiny_models)
    config["models"]["tiny-a"]["env"] = {"MODEL_OWN_SETTING": "yes"}
    corral = start_corral(config)
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    env = _environ(corral.model("tiny-a")["pid"])
    assert "OPENAI_API_KEY" not in env and "CORRAL_TEST_SECRET" not in env
    assert env["MODEL_OWN_SETTING"] == "yes"
    assert env["PATH"] == os.environ["PATH"]


# The failing step's traceback, and no other: the test provokes it.
@pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed",
                        allow=r'"instance.start_bookkeeping_failed".*IsADirectoryError')
def test_a_failing_spawn_bookkeeping_step_stops_the_child(start_corral, tiny_models, tmp_path):
    corral = start_corral(tiny_config(tiny_models, defaults={"start_backoff": 0}))
    # The pid file is written through a temp file next to it: a directory there makes that
    # write fail right after the child started.
    port = corral.url.rsplit(":", 1)[1]
    blocker = tmp_path / "state" / f"children-{port}.tmp"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.mkdir()
    resp = corral.chat("tiny-a", max_tokens=1)
    assert resp.status_code == 502, resp.text
    spawned = [e["pid"] for e in corral.log_events("child.spawned")]
    assert len(spawned) == 1
    wait_until(lambda: not _running(spawned[0]), timeout=10)
    assert corral.model("tiny-a")["state"] == "failed"
    blocker.rmdir()
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    assert corral.model("tiny-a")["state"] == "ready"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# A health check may find the killed child gone before its exit is seen.
@pytest.mark.expect_log("instance.health_failed")
def test_a_cold_start_does_not_wait_for_an_unrelated_eviction(start_corral, tiny_models):
    # max_loaded 2 with a and b loaded; a is frozen, so stopping it takes its whole
    # stop_grace. c evicts a (least recently used); d, arriving just after, evicts b and must
    # be served long before a's stop ends: no global lock held across a victim's stop.
    corral = start_corral(tiny_config(
        tiny_models, names=["tiny-a", "tiny-b", "tiny-c", "tiny-a2"],
        defaults={"stop_grace": 6, "health_interval": 30}, policy={"max_loaded": 2}))
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    assert corral.chat("tiny-b", max_tokens=1).status_code == 200
    frozen = corral.model("tiny-a")["pid"]
    os.kill(frozen, signal.SIGSTOP)
    finished: dict[str, float] = {}
    codes: dict[str, int] = {}

    def ask(name: str) -> None:
        codes[name] = corral.chat(name, max_tokens=1).status_code
        finished[name] = time.monotonic()

    try:
        first = threading.Thread(target=ask, args=("tiny-c",))
        first.start()
        wait_until(lambda: corral.model("tiny-a")["state"] == "stopping", timeout=5)
        began = time.monotonic()
        ask("tiny-a2")
        assert codes["tiny-a2"] == 200
        assert finished["tiny-a2"] - began < 4  # a's stop takes 6 s
        first.join(30)
    finally:
        if _running(frozen):
            os.kill(frozen, signal.SIGCONT)
    assert codes["tiny-c"] == 200
    assert finished["tiny-a2"] < finished["tiny-c"]
    assert corral.model("tiny-a")["state"] == "stopped"


@pytest.mark.expect_log("proxy.request_failed")
def test_groups_with_overlapping_members_fail_fast_instead_of_deadlocking(
        start_corral, tiny_models):
    config = tiny_config(tiny_models, names=["tiny-a", "tiny-b", "tiny-c"],
                         policy={"max_loaded": 2, "evict_timeout": 20})
    config["groups"] = {"ab": {"models": ["tiny-a", "tiny-b"]},
                        "bc": {"models": ["tiny-b", "tiny-c"]}}
    corral = start_corral(config)
    long = {"max_tokens": 3000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}
    results: dict[str, httpx.Response] = {}

    def run(group: str) -> None:
        results[group] = corral.http.post("/v1/batch/execute", json={"group": group, **long})

    holder = threading.Thread(target=run, args=("ab",))
    holder.start()
    wait_until(lambda: corral.model("tiny-a")["held"] and corral.model("tiny-b")["held"])
    began = time.monotonic()
    run("bc")
    waited = time.monotonic() - began
    holder.join(60)
    assert results["bc"].status_code == 503, results["bc"].text
    assert results["bc"].headers.get("Retry-After")
    assert "hold" in results["bc"].json()["error"]["message"]
    assert waited < 5  # not evict_timeout (20 s)
    assert results["ab"].status_code == 200
    # Once ab is done, bc runs.
    assert corral.http.post("/v1/batch/execute", json={"group": "bc", **long,
                                                       "max_tokens": 2}).status_code == 200


def test_requests_racing_ttl_stops_are_all_served(start_corral, tiny_models):
    # Requests arrive right around the moment the TTL fires, over and over: in its last
    # moments (the request and the sweep race for the model: the request keeps it if it took
    # a slot first) and the moment its stop began (the request finds it stopping and starts
    # it again). Each moment is waited for, not guessed; none loses its child.
    corral = start_corral(tiny_config(tiny_models, defaults={"ttl": 0.3}))

    def ttl_stops() -> int:
        return len([e for e in corral.log_events("instance.stop") if "ttl" in e["reason"]])

    def about_to_expire() -> bool:
        left = corral.model("tiny-a")["ttl_left"]  # None: expired already (not ready)
        return left is None or left < 0.03

    codes = []
    for i in range(20):
        codes.append(corral.chat("tiny-a", max_tokens=1).status_code)
        if i % 2:
            stops = ttl_stops()
            wait_until(lambda stops=stops: ttl_stops() > stops, timeout=10, interval=0.005)
        else:
            wait_until(about_to_expire, timeout=10, interval=0.005)
    codes.append(corral.chat("tiny-a", max_tokens=1).status_code)
    assert codes == [200] * 21
    assert ttl_stops() >= 10  # the race was really run: the TTL fired in between


def test_children_require_their_per_start_key(start_corral, tiny_models):
    # Any local user can reach 127.0.0.1:<port>; only corral knows the child's key.
    corral = start_corral(tiny_config(tiny_models))
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    port = corral.model("tiny-a")["port"]
    body = {"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    direct = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=10)
    assert direct.status_code == 401
    # Not in argv, which every local user can read (ps); in the child's environment.
    pid = corral.model("tiny-a")["pid"]
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    key = _environ(pid)["LLAMA_API_KEY"]
    assert len(key) >= 24 and key.encode() not in cmdline


def test_embeddings_only_on_models_that_enable_them(start_corral, tiny_models):
    config = tiny_config(tiny_models, names=["tiny-a", "tiny-b"])
    config["models"]["tiny-b"]["embeddings"] = True
    # A chat model's GGUF says pooling "none", which /v1/embeddings refuses: pick one.
    config["models"]["tiny-b"]["args"] = ["--pooling", "mean"]
    corral = start_corral(config)
    refused = corral.http.post("/v1/embeddings", json={"model": "tiny-a", "input": "hello"})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "embeddings_disabled" and "embeddings: true" in error["message"]
    assert corral.model("tiny-a")["state"] == "stopped"  # nothing was started for it
    assert not corral.log_events("child.spawned")
    vectors = corral.client().embeddings.create(model="tiny-b", input=["hello", "world"])
    assert len(vectors.data) == 2
    assert len(vectors.data[0].embedding) == 64  # the tiny model's n_embd
    assert "--embeddings" in corral.log_events("child.spawned")[0]["argv"]


def test_a_backup_takes_the_failed_members_place_under_max_loaded(start_corral, tiny_models):
    # Both members are loaded and held, filling max_loaded 2. tiny-b (a 64-token context)
    # refuses the long prompt; its backup tiny-c must still start, in tiny-b's place.
    config = tiny_config(tiny_models, names=["tiny-a", "tiny-b", "tiny-c"],
                         policy={"max_loaded": 2, "evict_timeout": 30})
    config["models"]["tiny-b"]["ctx"] = 64
    config["groups"] = {"g": {"models": ["tiny-a", "tiny-b"], "fallback": "replace_with",
                              "replace_with": {"tiny-b": "tiny-c"}}}
    corral = start_corral(config)
    assert corral.http.post("/admin/models/tiny-b/load").status_code == 200
    prompt = "x " * 400
    began = time.monotonic()
    resp = corral.http.post("/v1/batch/execute", json={
        "group": "g", "max_tokens": 2, "messages": [{"role": "user", "content": prompt}]})
    assert resp.status_code == 200, resp.text
    assert time.monotonic() - began < 25  # not a wait for evict_timeout
    members = {m["model"]: m for m in resp.json()["responses"]}
    assert members["tiny-c"]["status"] == "replaced"
    assert members["tiny-c"]["replaced"] == "tiny-b"
    assert corral.model("tiny-b")["state"] == "stopped"  # evicted for its backup
