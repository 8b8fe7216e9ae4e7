"""Child lifecycles under corral: TTL, LRU, in-flight protection, disconnects, deaths, shutdown."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from conftest import gone, port_is_free, sse_lines, tiny_config, wait_until

LONG = {"max_tokens": 3000, "ignore_eos": True}
# A few seconds alone; on a loaded 2-core box llama.cpp's spinning threads can stretch it past
# a minute (seen in a run with one core kept busy), and what these tests wait on is the order
# of things, not their speed.
SLOW_OK = 300
# max_loaded 1 gives each child every core (threads: cores / max_loaded): one thread instead,
# so that a second one does not spin beside the suite's other workers (7 times the CPU of a
# tiny model's generation on a busy 2-core box).
ONE_THREAD = {"threads": 1}




def test_ttl_stops_idle_model_and_frees_port(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models, defaults={"ttl": 1}))
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    state = corral.model("tiny-a")
    pid, port = state["pid"], state["port"]
    assert 0 < state["ttl_left"] <= 1
    wait_until(lambda: corral.model("tiny-a")["state"] == "stopped", timeout=15)
    wait_until(lambda: gone(pid), timeout=10)
    assert port_is_free(port)
    stop = [e for e in corral.log_events("instance.stop") if e["model"] == "tiny-a"]
    assert "ttl" in stop[-1]["reason"] and stop[-1]["pid"] == pid


def test_polling_models_health_and_admin_is_not_use(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models, defaults={"ttl": 1.5}))
    corral.chat("tiny-a", max_tokens=1)
    used = time.monotonic()
    # What Open WebUI and monitoring do all day, without a pause: were any of these counted
    # as use, the model would never go idle and this would run into the bound.
    deadline = used + 20
    while corral.model("tiny-a")["state"] != "stopped":
        assert time.monotonic() < deadline, "polling kept tiny-a loaded"
        corral.client().models.list()
        corral.http.get("/health")
        corral.http.get("/v1/models/tiny-a")
    assert time.monotonic() - used >= 1.5  # stopped by its TTL, not early


def test_lru_evicts_least_recently_used_idle_model(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models, names=["tiny-a", "tiny-b", "tiny-c"],
                                      policy={"max_loaded": 2}))
    corral.chat("tiny-a", max_tokens=1)
    corral.chat("tiny-b", max_tokens=1)
    corral.chat("tiny-a", max_tokens=1)  # a is now more recent than b
    b_pid = corral.model("tiny-b")["pid"]
    corral.chat("tiny-c", max_tokens=1)
    states = {name: m["state"] for name, m in corral.models().items()}
    assert states == {"tiny-a": "ready", "tiny-b": "stopped", "tiny-c": "ready"}
    assert gone(b_pid)
    evictions = [e for e in corral.log_events("instance.stop") if "evicted" in e["reason"]]
    assert [e["model"] for e in evictions] == ["tiny-b"]


def test_in_flight_model_is_never_evicted_new_request_waits(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models, names=["tiny-a", "tiny-b"],
                                      # Far longer than the generation, even on a busy box:
                                      # what is tested is that b waits, not how long.
                                      policy={"max_loaded": 1, "evict_timeout": 150},
                                      defaults=ONE_THREAD))
    corral.chat("tiny-a", max_tokens=1)
    a_result: list[httpx.Response] = []
    worker = threading.Thread(
        target=lambda: a_result.append(corral.chat("tiny-a", timeout=SLOW_OK, **LONG)))
    worker.start()
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 1)
    # Waits for a to drain, then evicts it.
    b = corral.chat("tiny-b", max_tokens=2, timeout=SLOW_OK)
    worker.join()
    assert a_result[0].status_code == 200
    assert a_result[0].json()["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert b.status_code == 200, b.text
    assert corral.model("tiny-a")["state"] == "stopped"


@pytest.mark.expect_log("proxy.request_failed")
def test_no_capacity_is_503_with_retry_after(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models, names=["tiny-a", "tiny-b"],
                                      policy={"max_loaded": 1, "evict_timeout": 0.5},
                                      defaults=ONE_THREAD))
    corral.chat("tiny-a", max_tokens=1)
    worker = threading.Thread(target=lambda: corral.chat("tiny-a", timeout=SLOW_OK, **LONG))
    worker.start()
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 1)
    b = corral.chat("tiny-b", max_tokens=2)
    assert b.status_code == 503
    assert int(b.headers["retry-after"]) > 0
    assert b.json()["error"]["code"] == "no_capacity"
    assert "tiny-a" in b.json()["error"]["message"]
    assert corral.model("tiny-a")["in_flight"] == 1  # untouched
    worker.join()


def _generation_cancelled(corral, model: str) -> int | None:
    """Tokens the child made before it cancelled, read from its log through corral.

    Not from the child's /slots: every /slots call wakes llama-server's result wait, which only
    checks for a closed client socket when that 1 s wait times out, so polling /slots hides
    the very cancellation it is looking for."""
    lines = corral.http.get(f"/admin/models/{model}/logs", params={"lines": 50}).json()["lines"]
    if not any("cancel task" in line for line in lines):
        return None
    done = [line for line in lines if "stop processing: n_tokens" in line]
    return int(done[-1].split("n_tokens =")[1].split(",")[0]) if done else None


def _assert_stopped_early(corral, model: str, asked: int) -> None:
    """The child cancelled well before making all `asked` tokens, and the lease came back."""
    made = wait_until(lambda: _generation_cancelled(corral, model), timeout=10)
    assert made < asked * 2 // 3, (made, asked)
    wait_until(lambda: corral.model(model)["in_flight"] == 0, timeout=10)


def test_client_disconnect_cancels_generation(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models))
    corral.chat("tiny-a", max_tokens=1)
    body = {"model": "tiny-a", "stream": True, "max_tokens": 6000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "go"}]}
    with httpx.Client(timeout=30) as client, \
            client.stream("POST", corral.url + "/v1/chat/completions", json=body) as resp:
        lines = sse_lines(resp)
        for _ in range(20):
            next(lines)
        assert corral.model("tiny-a")["in_flight"] == 1
    _assert_stopped_early(corral, "tiny-a", asked=6000)  # hung up after ~10 tokens


def test_non_stream_disconnect_cancels_generation(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models))
    corral.chat("tiny-a", max_tokens=1)
    with contextlib.suppress(openai.APITimeoutError):
        corral.client(timeout=0.5).chat.completions.create(
            model="tiny-a", messages=[{"role": "user", "content": "go"}], max_tokens=6000,
            extra_body={"ignore_eos": True})
    _assert_stopped_early(corral, "tiny-a", asked=6000)  # hung up after 0.5 s


# A health check may find the killed child gone before its exit is seen.
@pytest.mark.expect_log("instance.health_failed")
def test_child_killed_mid_stream_then_restarted(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models))
    corral.chat("tiny-a", max_tokens=1)
    pid = corral.model("tiny-a")["pid"]
    assert corral.spawned_pids("tiny-a") == [pid]
    stream = corral.client().chat.completions.create(
        model="tiny-a", messages=[{"role": "user", "content": "go"}], stream=True,
        max_tokens=6000, extra_body={"ignore_eos": True})
    received = 0
    try:
        for _ in stream:
            received += 1
            if received == 10:
                os.kill(pid, signal.SIGKILL)
        raise AssertionError("the stream ended without an error")
    except openai.APIError as exc:
        # The SSE error event the relay ends the stream with, as the SDK reports it.
        assert "tiny-a" in exc.message, exc.message
        assert isinstance(exc.body, dict) and exc.body.get("code") == "upstream_failed", exc.body
    assert received < 6000  # cut short, not a whole generation
    wait_until(lambda: gone(pid))
    wait_until(lambda: corral.model("tiny-a")["state"] == "failed")
    # The relay may mark it dead first ("died while serving"); the exit watcher then says
    # how it ended, once the child's last log lines are in.
    wait_until(lambda: "exited unexpectedly" in corral.model("tiny-a")["last_error"])
    assert corral.model("tiny-a")["in_flight"] == 0  # the lease came back
    # The very next request starts a new child and is answered by it.
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    state = corral.model("tiny-a")
    assert state["state"] == "ready" and state["pid"] != pid and state["restarts"] == 1
    assert corral.spawned_pids("tiny-a") == [pid, state["pid"]]


# A health check may find the killed child gone before its exit is seen.
@pytest.mark.expect_log("proxy.upstream_failed", "proxy.request_failed", "instance.health_failed")
def test_child_killed_during_non_stream_request_is_502(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models))
    corral.chat("tiny-a", max_tokens=1)
    killer = corral.kill_once_busy("tiny-a")
    resp = corral.chat("tiny-a", max_tokens=6000, ignore_eos=True)
    killer.join()
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "upstream_failed"


@pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed")
def test_start_timeout_kills_the_child_it_started(start_corral, tiny_models):
    config = tiny_config(tiny_models)
    config["models"]["tiny-a"]["start_timeout"] = 0.001
    corral = start_corral(config)
    resp = corral.chat("tiny-a")
    assert resp.status_code == 504
    error = resp.json()["error"]
    assert error["code"] == "model_start_timeout"
    assert "0.001s" in error["message"] and "not ready" in error["message"], error
    # A child really was started for it...
    spawned = corral.spawned("tiny-a")
    assert len(spawned) == 1 and spawned[0]["pid"] > 0
    pid = spawned[0]["pid"]
    # ...and is gone, not left running behind the failed start.
    wait_until(lambda: gone(pid), timeout=10)
    state = corral.model("tiny-a")
    assert state["state"] == "failed" and state["pid"] is None
    assert "not ready" in state["last_error"]


def test_sigterm_drains_in_flight_then_stops_children(start_corral, tiny_models):
    # A grace far longer than the generation, even on a busy box (and a shutdown budget that
    # holds it: by default the drain gives way to the saves and stops within 50 s).
    corral = start_corral(tiny_config(tiny_models, shutdown_grace=150, shutdown_timeout=400))
    corral.chat("tiny-a", max_tokens=1)
    pid = corral.model("tiny-a")["pid"]
    result: list[httpx.Response] = []
    worker = threading.Thread(
        target=lambda: result.append(corral.chat("tiny-a", timeout=SLOW_OK, **LONG)))
    worker.start()
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 1)
    corral.proc.send_signal(signal.SIGTERM)
    worker.join()
    assert result[0].status_code == 200
    assert result[0].json()["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert corral.proc.wait(15) == 0
    assert gone(pid)


@pytest.mark.expect_log(exit_code=-9)
def test_daemon_sigkill_leaves_no_orphans(start_corral, tiny_models):
    corral = start_corral(tiny_config(tiny_models, names=["tiny-a", "tiny-b"]))
    corral.chat("tiny-a", max_tokens=1)
    corral.chat("tiny-b", max_tokens=1)
    pids = [m["pid"] for m in corral.models().values()]
    assert all(psutil.pid_exists(p) for p in pids)
    corral.proc.kill()
    corral.proc.wait()
    wait_until(lambda: all(gone(p) for p in pids), timeout=5)


def test_orphan_check_finds_a_reparented_child_and_spares_a_recycled_pid(tmp_path, tiny_models):
    """The harness itself: at teardown, a recorded child still running with its command line
    fails the test (even one that is no child of corral's any more); a recorded pid that now
    runs something else does not."""
    from conftest import CorralFactory

    factory = CorralFactory(tmp_path)
    corral = factory(tiny_config(tiny_models))
    escaped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                "corral-orphan-check"], start_new_session=True)
    recycled = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        corral.seen_children.add((escaped.pid, (sys.executable, "-c",
                                                "import time; time.sleep(60)",
                                                "corral-orphan-check")))
        corral.seen_children.add((recycled.pid, ("/usr/bin/llama-server", "--port", "1")))
        try:
            factory.close()
        except AssertionError as exc:
            message = str(exc)
        else:
            raise AssertionError("the orphan check missed a surviving child")
        assert str(escaped.pid) in message and str(recycled.pid) not in message
        assert escaped.wait(5) == -signal.SIGKILL  # and it was cleaned up
        assert recycled.poll() is None  # the bystander was left alone
    finally:
        for proc in (escaped, recycled):
            proc.kill()
            proc.wait()


def test_state_file_reaps_children_of_a_killed_daemon(tmp_path):
    """The second line of defence, for children that escaped the parent-death signal."""
    from corral.supervisor.statefile import ChildRegistry

    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              start_new_session=True)
    registry = ChildRegistry(tmp_path / "children.json")
    registry.record([("tiny-a", orphan.pid)])
    record = json.loads((tmp_path / "children.json").read_text())
    assert record[0]["pid"] == orphan.pid
    assert ChildRegistry(tmp_path / "children.json").reap_leftovers() == [orphan.pid]
    assert orphan.wait(5) == -signal.SIGKILL
    assert not (tmp_path / "children.json").exists()


def test_state_file_spares_a_reused_pid(tmp_path):
    from corral.supervisor.statefile import ChildRegistry

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "children.json").write_text(json.dumps(
            [{"model": "x", "pid": bystander.pid, "create_time": 1.0}]))
        assert ChildRegistry(tmp_path / "children.json").reap_leftovers() == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_smollm2_knows_the_capital_of_france(start_corral, smol_model):
    config = {"models": {"smol": {"model": str(smol_model), "ctx": 2048}}}
    corral = start_corral(config)
    reply = corral.client().chat.completions.create(
        model="smol", temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
