"""Strategies applied for real: which llama-server children load at boot, which one makes room,
what a fixed appliance refuses and brings back, and a plugin loaded by path."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import tiny_config, wait_until

ROOT = Path(__file__).resolve().parent.parent
FOUR = ["tiny-a", "tiny-b", "tiny-c", "tiny-a2"]


def ready(corral, names):
    models = corral.models()
    return all(models[n]["state"] == "ready" for n in names)


def loaded(corral):
    return {n for n, m in corral.models().items() if m["state"] in ("starting", "ready")}


def test_pinned_group_loads_its_group_at_boot_and_swaps_others_around_it(start_corral,
                                                                         tiny_models):
    config = tiny_config(tiny_models, FOUR, policy={
        "strategy": "pinned-group", "groups": ["council"], "max_loaded": 3})
    config["groups"] = {"council": {"models": ["tiny-a", "tiny-b"]}}
    corral = start_corral(config)
    assert wait_until(lambda: ready(corral, ["tiny-a", "tiny-b"]), timeout=20)
    council_pids = {n: corral.model(n)["pid"] for n in ("tiny-a", "tiny-b")}
    assert corral.chat("tiny-c", max_tokens=2).status_code == 200
    # Full (3 of 3): tiny-a2 needs room. The council was used least recently, yet tiny-c goes.
    assert corral.chat("tiny-a2", max_tokens=2).status_code == 200
    assert loaded(corral) == {"tiny-a", "tiny-b", "tiny-a2"}
    assert {n: corral.model(n)["pid"] for n in council_pids} == council_pids
    assert corral.model("tiny-a")["pinned"] is True


def test_multi_group_never_evicts_another_groups_members(start_corral, tiny_models):
    config = tiny_config(tiny_models, FOUR, policy={
        "strategy": "multi-group", "shares": {"one": 2, "two": 1}, "max_loaded": 3})
    config["groups"] = {"one": {"models": ["tiny-a", "tiny-b"]},
                        "two": {"models": ["tiny-c", "tiny-a2"]}}
    corral = start_corral(config)
    # Group one fits its share: kept up from boot. Group two swaps inside its one slot.
    assert wait_until(lambda: ready(corral, ["tiny-a", "tiny-b"]), timeout=20)
    assert corral.chat("tiny-c", max_tokens=2).status_code == 200
    assert corral.chat("tiny-a2", max_tokens=2).status_code == 200
    assert loaded(corral) == {"tiny-a", "tiny-b", "tiny-a2"}
    evicted = [e for e in corral.log_events("instance.stop") if e["model"] == "tiny-c"]
    assert evicted and "evicted" in evicted[-1]["reason"]
    # A group request for group two runs in its share: one member at a time is all it has.
    corral.expect("proxy.request_failed")
    resp = corral.http.post("/v1/batch/execute", json={
        "group": "two", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert resp.status_code == 503, resp.text
    assert "in pool two" in resp.json()["error"]["message"]


# A health check may find the killed child gone before its exit is seen.
@pytest.mark.expect_log("instance.health_failed")
def test_fixed_appliance_serves_its_set_refuses_the_rest_and_restarts_a_crash(start_corral,
                                                                              tiny_models):
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b", "tiny-c"], defaults={"ttl": 1},
                         policy={"strategy": "fixed-appliance", "models": ["tiny-a", "tiny-b"],
                                 "max_loaded": 3})
    corral = start_corral(config)
    assert wait_until(lambda: ready(corral, ["tiny-a", "tiny-b"]), timeout=20)
    corral.expect("proxy.request_failed")  # the 503 below
    resp = corral.chat("tiny-c", max_tokens=2)
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["code"] == "model_not_served"
    assert "fixed set of models (tiny-a, tiny-b)" in error["message"]
    assert corral.model("tiny-c")["state"] == "stopped"
    # TTL off: idle past the configured 1 s, and past a TTL sweep after that, same children.
    # The sweep is what brings a crash back (below), so a crash brought back after the TTL
    # ran out proves a sweep looked at tiny-a idle past it: no guess at how long that takes.
    pid = corral.model("tiny-a")["pid"]
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    wait_until(lambda: time.time() - corral.model("tiny-a")["last_used"] > 1.0, timeout=10)
    # A crash comes back by itself, with no request asking for it.
    crashed = corral.model("tiny-b")["pid"]
    os.kill(crashed, signal.SIGKILL)
    def replaced() -> bool:
        now = corral.model("tiny-b")  # one reading: state and pid of the same moment
        return now["state"] == "ready" and now["pid"] not in (crashed, None)
    assert wait_until(replaced, timeout=20)
    assert [e["model"] for e in corral.log_events("daemon.restart_kept")] == ["tiny-b"]
    assert corral.model("tiny-a")["pid"] == pid and corral.model("tiny-a")["state"] == "ready"


def test_a_plugin_loaded_by_path_decides_eviction_and_kv_cache(start_corral, tiny_models,
                                                               smol_model):
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b"], policy={
        "strategy": f"plugin:{ROOT / 'presets/contrib/biggest_first.py'}:BiggestFirst",
        "options": {"big_model_bytes": 20_000_000, "kv_cache_type": "q8_0"},
        "max_loaded": 2})
    config["models"]["smol"] = {"model": str(smol_model), "ctx": 2048}
    corral = start_corral(config)
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    assert corral.chat("smol", max_tokens=2).status_code == 200
    smol = corral.model("smol")
    assert (smol["cache_type_k"], smol["cache_type_v"]) == ("q8_0", "q8_0")
    cmdline = psutil.Process(smol["pid"]).cmdline()
    assert cmdline[cmdline.index("--cache-type-k") + 1] == "q8_0"
    assert corral.model("tiny-a")["cache_type_k"] is None  # small: as configured
    # Least recently used is tiny-a; the plugin stops the biggest idle model instead.
    assert corral.chat("tiny-b", max_tokens=2).status_code == 200
    assert loaded(corral) == {"tiny-a", "tiny-b"}


def test_a_reload_to_a_fixed_appliance_stops_what_it_does_not_serve(start_corral, tiny_models):
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b"])
    corral = start_corral(config)
    assert corral.chat("tiny-b", max_tokens=2).status_code == 200
    config["policy"] = {"strategy": "fixed-appliance", "models": ["tiny-a"]}
    corral.config_path.write_text(yaml.safe_dump(config))
    attempt = corral.http.post("/admin/reload").json()
    assert attempt["ok"], attempt
    assert wait_until(lambda: corral.model("tiny-a")["state"] == "ready"
                      and corral.model("tiny-b")["state"] == "stopped", timeout=20)
    corral.expect("proxy.request_failed")
    assert corral.chat("tiny-b", max_tokens=2).json()["error"]["code"] == "model_not_served"
