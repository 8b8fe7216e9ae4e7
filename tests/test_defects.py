"""The defects issue 23 measured on a running daemon, each reproduced on a real corral with
real llama-server children: each of these failed on main at 661fd5d."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

import httpx

from conftest import gone, tiny_config, wait_until

GO = [{"role": "user", "content": "go"}]


def _body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": GO, **extra}




def test_a_start_that_crashes_ends_failed_not_wedged_in_starting(start_corral, tmp_path):
    """Defect 1: a typo'd model split over a local RPC worker (the planner reads the GGUF and
    raises FileNotFoundError, not StartFailed): 500 and `starting` for good, before."""
    corral = start_corral({"models": {"big": {"model": str(tmp_path / "typo.gguf"),
                                              "rpc": {"workers": ["local"]}}}})
    corral.expect("proxy.start_failed", "proxy.request_failed")
    first = corral.http.post("/v1/chat/completions", json=_body("big", max_tokens=1))
    assert first.status_code in (502, 503), first.text
    assert first.json()["error"]["code"] in ("model_start_failed", "workers_unavailable")
    # The path and the exception's text are the operator's: /admin and the log, not /v1.
    assert str(tmp_path) not in first.text and "typo.gguf" not in first.text, first.text
    state = corral.model("big")
    assert state["state"] == "failed", state
    assert "typo.gguf" in (state["last_error"] or ""), state
    assert state["start_failures"] == 1, state
    again = corral.http.post("/v1/chat/completions", json=_body("big", max_tokens=1))
    assert again.status_code == 503 and again.json()["error"]["code"] == "model_start_backoff"
    # Not counted as loaded: another model can start under max_loaded 1 (it was blocked).
    assert corral.model("big")["state"] == "failed"


def test_a_user_key_cannot_unload_a_pinned_or_busy_model(start_corral, tiny_models):
    """Defect 3: with a user key, POST /models/unload stopped what the operator pinned."""
    config = tiny_config(tiny_models, ["tiny-a"], api_keys=["user"],
                         admin_api_keys=["admin"],
                         policy={"strategy": "fixed-appliance", "models": ["tiny-a"]})
    corral = start_corral(config, api_key="admin")
    wait_until(lambda: corral.model("tiny-a")["state"] == "ready", timeout=30)
    user = {"Authorization": "Bearer user"}
    refused = httpx.post(corral.url + "/models/unload", json={"model": "tiny-a"}, headers=user)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "permission_denied"
    assert corral.model("tiny-a")["state"] == "ready"
    # The operator may.
    done = httpx.post(corral.url + "/models/unload", json={"model": "tiny-a"},
                      headers={"Authorization": "Bearer admin"})
    assert done.status_code == 200, done.text


def test_a_user_key_cannot_cut_off_others_requests_but_may_unload_an_idle_model(
        start_corral, tiny_models):
    config = tiny_config(tiny_models, api_keys=["user"], admin_api_keys=["admin"])
    corral = start_corral(config, api_key="admin")
    corral.expect("proxy.upstream_failed")
    user = {"Authorization": "Bearer user"}
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    pid = corral.model("tiny-a")["pid"]
    done = threading.Event()

    def stream() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(corral.url + "/v1/chat/completions", headers=user, timeout=60,
                       json=_body("tiny-a", max_tokens=4000, ignore_eos=True, stream=True))
        done.set()

    threading.Thread(target=stream).start()
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 1, timeout=10)
    os.kill(pid, signal.SIGSTOP)  # keeps the request in flight
    try:
        busy = httpx.post(corral.url + "/models/unload", json={"model": "tiny-a"},
                          headers=user)
        assert busy.status_code == 409, busy.text
        assert busy.json()["error"]["code"] == "model_busy"
        assert corral.model("tiny-a")["state"] == "ready"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert done.wait(60)
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 0, timeout=10)
    idle = httpx.post(corral.url + "/models/unload", json={"model": "tiny-a"}, headers=user)
    assert idle.status_code == 200, idle.text
    wait_until(lambda: corral.model("tiny-a")["state"] == "stopped", timeout=30)


def test_a_request_timeout_probes_the_child_and_the_next_request_is_served(
        start_corral, tiny_models):
    """Defect 4: SIGSTOP a ready child; the first request gets 504 after first_byte_timeout,
    and the next one (before: another 504 until the watchdog's third miss) a fresh child."""
    config = tiny_config(tiny_models)
    config["models"]["tiny-a"].update(first_byte_timeout=2, health_interval=30,
                                      health_timeout=0.5)
    corral = start_corral(config)
    corral.expect("proxy.upstream_failed", "proxy.request_failed")
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    pid = corral.model("tiny-a")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        first = corral.http.post("/v1/chat/completions", json=_body("tiny-a", max_tokens=4))
        assert first.status_code == 504, first.text
        wait_until(lambda: gone(pid), timeout=10)
        started = time.monotonic()
        second = corral.http.post("/v1/chat/completions", json=_body("tiny-a", max_tokens=4))
        assert second.status_code == 200, second.text
        assert time.monotonic() - started < 2  # no second wait for first_byte_timeout
        assert corral.model("tiny-a")["pid"] != pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_an_unload_ends_stopped_even_when_the_child_dies_during_its_drain(
        start_corral, tiny_models):
    """Defect 5: a stream in flight, a second request queued, an unload, then the child
    killed during the drain: the queued request restarted the model under the running stop,
    and the unload's model was `ready` again."""
    config = tiny_config(tiny_models, shutdown_grace=60)
    config["models"]["tiny-a"].update(parallel=1, idle_timeout=60)
    corral = start_corral(config)
    corral.expect("proxy.upstream_failed", "proxy.request_failed", "proxy.stream_broken")
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    pid = corral.model("tiny-a")["pid"]
    results: dict[str, httpx.Response | BaseException] = {}

    def call(key: str, method: str, path: str, **kw: Any) -> None:
        try:
            results[key] = httpx.request(method, corral.url + path, timeout=120, **kw)
        except BaseException as exc:
            results[key] = exc

    stream = threading.Thread(target=call, args=("stream", "POST", "/v1/chat/completions"),
                              kwargs={"json": _body("tiny-a", max_tokens=4000, stream=True,
                                                    ignore_eos=True)})
    stream.start()
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 1, timeout=10)
    os.kill(pid, signal.SIGSTOP)  # the stream stays in flight for as long as the test needs
    queued = threading.Thread(target=call, args=("queued", "POST", "/v1/chat/completions"),
                              kwargs={"json": _body("tiny-a", max_tokens=1)})
    queued.start()
    wait_until(lambda: corral.model("tiny-a")["queue"] == 1, timeout=10)
    unload = threading.Thread(target=call, args=("unload", "POST",
                                                 "/admin/models/tiny-a/unload"))
    unload.start()
    wait_until(lambda: corral.model("tiny-a")["state"] == "draining", timeout=10)
    os.kill(pid, signal.SIGKILL)
    for thread in (unload, queued, stream):
        thread.join(60)
    assert isinstance(results["unload"], httpx.Response), results["unload"]
    assert results["unload"].status_code == 200, results["unload"].text
    queued_answer = results["queued"]
    assert isinstance(queued_answer, httpx.Response), queued_answer
    assert queued_answer.status_code == 503, queued_answer.text
    assert queued_answer.json()["error"]["code"] == "model_unloaded"
    state = corral.model("tiny-a")
    assert state["state"] == "stopped" and state["starts"] == 1, state
    # Started once, for the first request: nothing started it again under the unload.
    starts = [e for e in corral.log_events("instance.state") if e.get("new") == "starting"]
    assert len(starts) == 1, starts
