"""Replicas: several identical llama-server children behind one model name, least busy first,
each its own state machine; scaled up by the queue, down by TTL, resized by a reload."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
import yaml

from conftest import tiny_config, wait_until

LONG = {"max_tokens": 3000, "ignore_eos": True}


def replicas_of(corral, model):
    return {n: m for n, m in corral.models().items() if m["replica_of"] == model}


def up(corral, model):
    return sorted(n for n, m in replicas_of(corral, model).items()
                  if m["state"] in ("starting", "ready"))


def in_background(corral, model, results, **extra):
    def run():
        results.append(corral.chat(model, **{**LONG, **extra}))
    worker = threading.Thread(target=run)
    worker.start()
    return worker


def test_fixed_replicas_start_together_and_share_the_load(start_corral, tiny_models):
    config = tiny_config(tiny_models, ["tiny-a"])
    config["models"]["tiny-a"]["replicas"] = 2
    corral = start_corral(config)
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    assert wait_until(lambda: up(corral, "tiny-a") == ["tiny-a", "tiny-a#2"], timeout=20)
    assert wait_until(lambda: all(m["state"] == "ready"
                                  for m in replicas_of(corral, "tiny-a").values()), timeout=20)
    rows = replicas_of(corral, "tiny-a")
    assert rows["tiny-a#2"]["replica"] == 2 and rows["tiny-a"]["pid"] != rows["tiny-a#2"]["pid"]
    # Two long requests at once, one slot each: least busy routing puts one on each replica.
    results: list[httpx.Response] = []
    workers = [in_background(corral, "tiny-a", results) for _ in range(2)]
    both_busy = wait_until(lambda: [m["in_flight"] for m in
                                    replicas_of(corral, "tiny-a").values()] == [1, 1],
                           timeout=20, interval=0.02)
    for worker in workers:
        worker.join()
    assert both_busy
    assert [r.status_code for r in results] == [200, 200]
    assert all(r.json()["model"] == "tiny-a" for r in results)
    # Each replica has its own log and its own state.
    logs = corral.http.get("/admin/models/tiny-a%232/logs").json()
    assert logs["model"] == "tiny-a#2" and logs["pid"] == rows["tiny-a#2"]["pid"]


# A health check may find the killed child gone before its exit is seen.
@pytest.mark.expect_log("instance.health_failed")
def test_a_replica_that_dies_leaves_the_others_serving_and_is_replaced(start_corral,
                                                                       tiny_models):
    config = tiny_config(tiny_models, ["tiny-a"])
    config["models"]["tiny-a"]["replicas"] = 2
    corral = start_corral(config)
    corral.http.post("/admin/models/tiny-a/load")
    assert wait_until(lambda: all(m["state"] == "ready"
                                  for m in replicas_of(corral, "tiny-a").values()), timeout=20)
    results: list[httpx.Response] = []
    worker = in_background(corral, "tiny-a", results)
    busy = wait_until(lambda: next((n for n, m in replicas_of(corral, "tiny-a").items()
                                    if m["in_flight"] == 1), None), timeout=20, interval=0.02)
    idle = next(n for n in replicas_of(corral, "tiny-a") if n != busy)
    os.kill(corral.model(idle)["pid"], signal.SIGKILL)
    worker.join()
    assert results[0].status_code == 200  # the stream on the other replica never noticed
    # The next request is served at once by the survivor, and brings replicas.min back.
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    assert wait_until(lambda: up(corral, "tiny-a") == ["tiny-a", "tiny-a#2"], timeout=20)


def test_replicas_scale_up_with_the_queue_and_down_on_ttl(start_corral, tiny_models):
    config = tiny_config(tiny_models, ["tiny-a"])
    config["models"]["tiny-a"].update(
        replicas={"min": 1, "max": 2, "scale_after": 0.5}, ttl=3)
    corral = start_corral(config)
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    assert up(corral, "tiny-a") == ["tiny-a"]  # min 1: nothing else started
    results: list[httpx.Response] = []
    first = in_background(corral, "tiny-a", results)
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 1, timeout=20, interval=0.02)
    # The only replica is busy: this request waits, and after scale_after a second one starts.
    waiter = in_background(corral, "tiny-a", results, max_tokens=2, ignore_eos=False)
    assert wait_until(lambda: up(corral, "tiny-a") == ["tiny-a", "tiny-a#2"], timeout=20)
    waiter.join(30)
    assert results and results[0].status_code == 200
    assert corral.model("tiny-a")["in_flight"] == 1  # served by the new replica, not queued
    first.join()
    assert [r.status_code for r in results] == [200, 200]
    assert corral.log_events("daemon.scaled_up")
    # Idle past ttl, the replicas stop again.
    assert wait_until(lambda: up(corral, "tiny-a") == [], timeout=20)


def test_a_reload_adds_and_retires_replicas_without_touching_the_first(start_corral,
                                                                       tiny_models):
    config = tiny_config(tiny_models, ["tiny-a"])
    corral = start_corral(config)
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    pid = corral.model("tiny-a")["pid"]

    def reload_with(replicas):
        config["models"]["tiny-a"]["replicas"] = replicas
        corral.config_path.write_text(yaml.safe_dump(config))
        attempt = corral.http.post("/admin/reload").json()
        assert attempt["ok"], attempt

    reload_with(3)
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    assert wait_until(lambda: up(corral, "tiny-a") == ["tiny-a", "tiny-a#2", "tiny-a#3"],
                      timeout=20)
    assert corral.model("tiny-a")["pid"] == pid
    reload_with(1)
    assert wait_until(lambda: list(replicas_of(corral, "tiny-a")) == [], timeout=20)
    assert corral.model("tiny-a")["pid"] == pid
    assert corral.http.post("/admin/models/tiny-a/unload").status_code == 200
    assert corral.model("tiny-a")["state"] == "stopped"
