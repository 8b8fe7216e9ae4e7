"""Admin load overrides against the model's lifecycle (issue 36, review R2): what an unload, a
second load, a stream in flight, a crash of a pinned child and a config reload do to a load
with overrides, and who may send one. One rule each, as docs/api.md says it:

- an unload wins over a load with overrides, whenever it comes (even while the load's
  overrides are still being checked);
- two loads with different settings: the first that gets the model wins, the other is a 409
  settings_differ (never a 200 over settings it did not ask for);
- `restart: true` drains: a stream in flight on the old child ends whole;
- overrides are the settings of the children their load starts: a crash, a KV step or a
  reload that changes the model restarts it with the config; a reload that does not change
  the model leaves its child (and its overrides) running.

The model's binary is a wrapper of llama-server that can hold its `--help` (which the check of a
KV type override asks) until the test lets it go: the test waits on files, not durations."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.supervisor.backends.binaries import find_executable

from conftest import Corral, CorralFactory, sse_lines, wait_until
from tinymodel import write_tiny_llama

ADMIN_KEY = "admin-secret"
USER_KEY = "user-secret"


class Gate:
    """The wrapper's switch: while `block` exists, `--help` says so (`asked`) and waits."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.block = folder / "block"
        self.asked = folder / "asked"
        self.start_block = folder / "start-block"  # held the same way: a child's start
        self.started = folder / "started"
        self.binary = folder / "llama-server"
        self._version = 0
        self._write()

    def _write(self) -> None:
        real = find_executable(None, ("llama-server",))
        # Its size changes with each version: corral's --help cache is per file version.
        self.binary.write_text(
            f"#!/bin/sh\n# version {self._version}\n"
            f"if [ \"$1\" = --help ] && [ -e {self.block} ]; then\n"
            f"  touch {self.asked}\n"
            f"  while [ -e {self.block} ]; do sleep 0.02; done\n"
            f"elif [ \"$1\" != --help ] && [ -e {self.start_block} ]; then\n"
            f"  touch {self.started}\n"
            f"  while [ -e {self.start_block} ]; do sleep 0.02; done\n"
            f"fi\nexec {real} \"$@\"\n")
        self.binary.chmod(0o755)

    def close(self) -> None:
        """The next KV check asks --help again, and that --help waits until open()."""
        self.asked.unlink(missing_ok=True)
        self.block.touch()
        self._version += 1
        self._write()

    def wait_asked(self) -> None:
        wait_until(self.asked.exists, timeout=20)

    def open(self) -> None:
        self.block.unlink(missing_ok=True)
        self.start_block.unlink(missing_ok=True)

    def hold_starts(self) -> None:
        self.started.unlink(missing_ok=True)
        self.start_block.touch()


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Gate:
    return Gate(tmp_path_factory.mktemp("gate"))


def config(model: str, gate: Gate, tiny_ctx: int = 1024) -> dict[str, Any]:
    return {
        "api_keys": [USER_KEY], "admin_api_keys": [ADMIN_KEY],
        "shutdown_grace": 30,
        "defaults": {"ctx": 1024, "prompt_cache": False},
        # kept is pinned: tiny and other take turns in the second place.
        "policy": {"max_loaded": 2, "evict_timeout": 60},
        "models": {"tiny": {"model": model, "ctx": tiny_ctx, "binary": str(gate.binary)},
                   "kept": {"model": model},
                   "drafty": {"model": model, "binary": str(gate.binary),
                              "args": ["--model-draft", model]},
                   # Room for a stream that lasts while a test does its part.
                   "other": {"model": model, "ctx": 32768}},
        "groups": {"core": {"models": ["kept"], "pinned": True}},
    }


@pytest.fixture(scope="module")
def setup(start_corral_module: CorralFactory, tmp_path_factory: pytest.TempPathFactory,
          gate: Gate) -> tuple[Corral, str]:
    # Heads of 32 dims: quantized KV types run on it.
    model = str(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", 1, n_head=2))
    corral = start_corral_module(config(model, gate), api_key=ADMIN_KEY)
    wait_until(lambda: corral.model("kept")["state"] == "ready", timeout=30)
    return corral, model


@pytest.fixture
def corral(setup: tuple[Corral, str], gate: Gate) -> Any:
    corral = setup[0]
    yield corral
    gate.open()
    for name in ("tiny", "other", "drafty"):
        corral.http.post(f"/admin/models/{name}/unload?force=1")
        wait_until(lambda n=name: corral.model(n)["state"] == "stopped", timeout=30)


def load(corral: Corral, name: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return corral.http.post(f"/admin/models/{name}/load", json=body, timeout=120)


def in_background(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


@contextlib.contextmanager
def streaming(corral: Corral, model: str) -> Iterator[Iterator[str]]:
    """A stream of `model` that lasts, its first event in: the model serves it until the
    block ends (its client hangs up). Its lines, for a test that reads on."""
    with corral.http.stream("POST", "/v1/chat/completions", json={
            "model": model, "stream": True, "max_tokens": 100000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}) as stream:
        lines = sse_lines(stream)  # kept: a closed iterator closes the stream
        next(line for line in lines if line.startswith("data:"))
        yield lines


def argv_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


# -- an unload wins -------------------------------------------------------------------------------

def test_an_unload_while_the_overrides_are_checked_wins(corral: Corral, gate: Gate):
    """The unload comes after the load was asked, while its KV type is being checked (the
    binary's --help): the model stays stopped, and the load says it was called off."""
    corral.expect(allow="was unloaded while this load was under way")
    gate.close()
    thread, out = in_background(lambda: load(corral, "tiny", {"cache_type_k": "q8_0"}))
    gate.wait_asked()
    assert corral.http.post("/admin/models/tiny/unload").status_code == 200
    gate.open()
    thread.join(60)
    answer = out[0]
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "model_unloaded"
    assert corral.model("tiny")["state"] == "stopped"
    assert corral.model("tiny")["wish"] == "absent"


def test_an_unload_during_a_restart_with_overrides_wins(corral: Corral):
    """A restart with new settings drains the old child (a stream holds it); a forced unload
    meanwhile stops everything, and the load answers 503 model_unloaded (not a 500, not a
    hang-up), the model stopped. On `other`: room for a stream that outlasts the restart's
    start (tiny's 1,024 tokens could all be written before it, and then nothing drains)."""
    corral.expect(allow="was unloaded while this load was under way")
    assert load(corral, "other").status_code == 200
    with streaming(corral, "other") as lines:
        thread, out = in_background(
            lambda: load(corral, "other", {"ctx": 2048, "restart": True}))
        wait_until(lambda: corral.model("other")["model_state"] == "restarting")
        assert corral.http.post("/admin/models/other/unload?force=1").status_code == 200
        thread.join(60)
        for _ in lines:  # cut by the forced unload: what matters is the load's answer
            pass
    answer = out[0]
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "model_unloaded"
    wait_until(lambda: corral.model("other")["state"] == "stopped")
    assert corral.model("other")["wish"] == "absent"


# -- two loads ------------------------------------------------------------------------------------

def test_two_loads_with_different_settings_never_both_succeed(corral: Corral, gate: Gate):
    """Both are checked at once (their --help held, then let go together): whichever gets the
    model first starts it with its settings; the other is a 409 settings_differ, never a 200
    over settings it did not ask for."""
    gate.close()
    asked = [{"cache_type_k": "q8_0", "ctx": 2048}, {"cache_type_k": "q4_0", "ctx": 4096}]
    runs = [in_background(lambda b=b: load(corral, "tiny", b)) for b in asked]
    gate.wait_asked()
    gate.open()
    for thread, _ in runs:
        thread.join(60)
    answers = [out[0] for _, out in runs]
    codes = sorted(a.status_code for a in answers)
    assert codes == [200, 409], [a.text for a in answers]
    for body, answer in zip(asked, answers, strict=True):
        if answer.status_code == 200:
            assert answer.json()["overrides"] == body
            argv = argv_of(answer.json()["pid"])
            assert flag(argv, "--ctx-size") == str(body["ctx"])
            assert flag(argv, "--cache-type-k") == body["cache_type_k"]
        else:
            assert answer.json()["error"]["code"] == "settings_differ"


def test_a_second_load_while_the_first_waits_for_room_is_refused(corral: Corral):
    """The first load has claimed the model but waits for room (other serves a stream, and
    max_loaded is reached), so no child of tiny is starting yet: a load with other settings
    is a 409, not a 200 that takes over the first one's start."""
    assert load(corral, "other").status_code == 200
    with streaming(corral, "other"):
        thread, out = in_background(lambda: load(corral, "tiny", {"ctx": 2048}))
        wait_until(lambda: corral.model("tiny")["queue"] > 0)
        assert corral.model("tiny")["state"] == "stopped"
        second = load(corral, "tiny", {"ctx": 4096})
        assert second.status_code == 409, second.text
        assert second.json()["error"]["code"] == "settings_differ"
        same = in_background(lambda: load(corral, "tiny", {"ctx": 2048}))
    # The stream's client hung up: other is idle, evicted, and tiny starts.
    thread.join(60)
    same[0].join(60)
    for answer in (out[0], same[1][0]):
        assert answer.status_code == 200, answer.text
        assert answer.json()["overrides"] == {"ctx": 2048}
    assert flag(argv_of(corral.model("tiny")["pid"]), "--ctx-size") == "2048"


def test_a_restart_without_overrides_during_a_load_with_them_is_refused(corral: Corral,
                                                                        gate: Gate):
    """A load with overrides has started tiny's child (held starting); a load with restart:
    true and no overrides asks the config's settings: a 409, not a restart that drops the
    first load's claim and answers that load 200 over the config's settings."""
    gate.hold_starts()
    try:
        thread, out = in_background(lambda: load(corral, "tiny", {"ctx": 2048}))
        wait_until(gate.started.exists, timeout=20)
        second = load(corral, "tiny", {"restart": True})
        assert second.status_code == 409, second.text
        assert second.json()["error"]["code"] == "settings_differ"
    finally:
        gate.open()
    thread.join(60)
    answer = out[0]
    assert answer.status_code == 200, answer.text
    assert answer.json()["overrides"] == {"ctx": 2048}
    assert flag(argv_of(answer.json()["pid"]), "--ctx-size") == "2048"


def test_an_unload_while_the_load_waits_for_room_wins_and_ends_its_claim(corral: Corral):
    """The load with overrides waits for room (other serves a stream); an unload of tiny
    meanwhile: the load answers 503 model_unloaded, and its overrides are no one's: the next
    plain load runs the config."""
    corral.expect(allow="was unloaded while")
    assert load(corral, "other").status_code == 200
    with streaming(corral, "other"):
        thread, out = in_background(lambda: load(corral, "tiny", {"ctx": 2048}))
        wait_until(lambda: corral.model("tiny")["queue"] > 0)
        assert corral.http.post("/admin/models/tiny/unload").status_code == 200
        thread.join(60)
    answer = out[0]
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "model_unloaded"
    assert corral.model("tiny")["state"] == "stopped"
    plain = load(corral, "tiny")
    assert plain.status_code == 200, plain.text
    assert plain.json()["overrides"] is None and plain.json()["ctx"] == 1024


def test_a_draft_override_start_does_not_block_the_daemon(corral: Corral, gate: Gate):
    """Which flag a draft setting takes is asked of the binary's --help: that must not run on
    the daemon's event loop (a slow --help would stall every request). The wrapper holds its
    --help; meanwhile the daemon answers."""
    gate.close()
    thread, out = in_background(lambda: load(corral, "drafty", {"draft_max": 2}))
    gate.wait_asked()
    try:
        health = corral.http.get("/health", timeout=5)
        assert health.status_code == 200
    finally:
        gate.open()
    thread.join(60)
    answer = out[0]
    assert answer.status_code == 200, answer.text
    argv = argv_of(answer.json()["pid"])
    assert "2" in (flag(argv, "--spec-draft-n-max"), flag(argv, "--draft-max"))


# -- a stream in flight ---------------------------------------------------------------------------

def test_a_restart_with_overrides_drains_a_stream_in_flight(corral: Corral):
    """The restart begins while a long stream runs on the old child: the child lives on
    until the stream has ended whole (every token, [DONE], no error), then the new one
    starts with the asked settings."""
    assert load(corral, "other").status_code == 200
    old = corral.model("other")["pid"]
    tokens = 3000
    with corral.http.stream("POST", "/v1/chat/completions", json={
            "model": "other", "stream": True, "max_tokens": tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]}) as stream:
        lines = sse_lines(stream)
        first = next(line for line in lines if line.startswith("data:"))
        thread, out = in_background(
            lambda: load(corral, "other", {"ctx": 2048, "restart": True}))
        wait_until(lambda: corral.model("other")["model_state"] == "restarting")
        assert Path(f"/proc/{old}").exists()  # draining, not cut
        after = [line for line in lines if line.startswith("data:")]
    thread.join(60)
    assert len(after) > 1 and after[-1] == "data: [DONE]"
    events = [json.loads(line[5:]) for line in (first, *after[:-1])]
    assert not any("error" in e for e in events)
    assert [e["usage"]["completion_tokens"] for e in events if e.get("usage")] == [tokens]
    answer = out[0]
    assert answer.status_code == 200, answer.text
    shown = answer.json()
    assert shown["pid"] != old and shown["overrides"] == {"ctx": 2048}
    assert flag(argv_of(shown["pid"]), "--ctx-size") == "2048"


def test_parallel_override_queues_requests_beyond_its_slots(corral: Corral):
    assert load(corral, "tiny", {"parallel": 2}).status_code == 200
    assert corral.model("tiny")["parallel"] == 2

    def ask() -> int:
        return corral.http.post("/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 20, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}).status_code
    runs = [in_background(ask) for _ in range(6)]
    for thread, _ in runs:
        thread.join(120)
    assert [out[0] for _, out in runs] == [200] * 6


# -- crashes and reloads --------------------------------------------------------------------------

def test_a_pinned_model_that_crashes_comes_back_with_its_config(corral: Corral):
    """Overrides are the settings of the start their load made: keep-up's restart runs the
    config, and /admin/models says so."""
    answer = load(corral, "kept", {"ctx": 2048, "restart": True})
    assert answer.status_code == 200, answer.text
    pid = answer.json()["pid"]
    assert answer.json()["overrides"] == {"ctx": 2048}
    corral.expect("instance.health_failed")  # a probe may find it gone before its exit
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: corral.model("kept")["state"] == "ready"
               and corral.model("kept")["pid"] not in (None, pid), timeout=30)
    shown = corral.model("kept")
    assert shown["overrides"] is None and shown["ctx"] == 1024
    assert flag(argv_of(shown["pid"]), "--ctx-size") == "1024"


def test_a_reload_keeps_overrides_unless_it_changes_the_model(setup: tuple[Corral, str],
                                                               corral: Corral, gate: Gate):
    model = setup[1]
    answer = load(corral, "tiny", {"ctx": 2048})
    assert answer.status_code == 200, answer.text
    pid = answer.json()["pid"]
    try:
        # Another model changes: tiny's child runs on with its overrides.
        changed = config(model, gate)
        changed["models"]["other"]["ctx"] = 16384
        corral.reload_with(changed)
        shown = corral.model("tiny")
        assert (shown["pid"], shown["overrides"], shown["ctx"]) == (pid, {"ctx": 2048}, 2048)
        # tiny's own config changes: it restarts with the new config; its overrides end.
        corral.reload_with(config(model, gate, tiny_ctx=512))
        wait_until(lambda: corral.model("tiny")["state"] == "ready"
                   and corral.model("tiny")["pid"] != pid, timeout=30)
        shown = corral.model("tiny")
        assert shown["overrides"] is None and shown["ctx"] == 512
        assert flag(argv_of(shown["pid"]), "--ctx-size") == "512"
    finally:
        corral.reload_with(config(model, gate))


# -- who may ask, and how -------------------------------------------------------------------------

def test_a_user_key_or_another_origin_may_not_load_with_overrides(corral: Corral):
    as_user = corral.http.post("/admin/models/tiny/load", json={"ctx": 2048},
                               headers={"Authorization": f"Bearer {USER_KEY}"})
    assert as_user.status_code in (401, 403), as_user.text
    browser = corral.http.post("/admin/models/tiny/load", json={"ctx": 2048},
                               headers={"Origin": "http://evil.example"})
    assert browser.status_code == 403, browser.text
    assert corral.model("tiny")["state"] == "stopped"


@pytest.mark.parametrize(("content", "kind", "param"), [
    ("not json", "application/json", None),
    ("[1, 2]", "application/json", None),
    ('{"ctx": 1e400}', "application/json", "ctx"),
    ('{"ctx": 4096.0}', "application/json", "ctx"),
    ('{"ctx": true}', "application/json", "ctx"),
    ('{"ctx": null}', "application/json", "ctx"),
    ('{"ctx": -5}', "application/json", "ctx"),
    ('{"parallel": 100000000000000000000000000000}', "application/json", "parallel"),
    ('{"cache_type_k": 8}', "application/json", "cache_type_k"),
    ('{"cache_type_k": "' + "q" * 100000 + '"}', "application/json", "cache_type_k"),
    ('{"ctx": 2048}', "text/plain", None),
])
def test_malformed_bodies_are_refused_and_start_nothing(corral: Corral, content: str, kind: str,
                                                        param: str | None):
    answer = corral.http.post("/admin/models/tiny/load", content=content,
                              headers={"Content-Type": kind})
    assert answer.status_code in (400, 415), answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error", error
    if param is not None:
        assert error["param"] == param, error
        assert len(error["message"]) < 300
    assert corral.model("tiny")["state"] == "stopped"


def test_the_cli_passes_overrides_to_a_running_daemon(corral: Corral):
    env = {**os.environ, "CORRAL_URL": corral.url, "CORRAL_ADMIN_KEY": ADMIN_KEY}
    run = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "load", "--ctx",
                          "2048", "--parallel", "2", "tiny"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    shown = corral.model("tiny")
    assert shown["overrides"] == {"ctx": 2048, "parallel": 2}
    refused = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "load", "--ctx",
                              "4096", "tiny"], capture_output=True, text=True, env=env,
                             timeout=120)
    assert refused.returncode != 0 and "restart" in refused.stderr + refused.stdout
    bad = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "load", "--ctx", "0",
                          "tiny"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "ctx" in bad.stderr + bad.stdout


# -- placement ------------------------------------------------------------------------------------

FAKE_GPU = Path(__file__).with_name("fake_gpu.py")


def test_a_ctx_that_cannot_fit_is_refused_before_anything_is_evicted(
        start_corral: CorralFactory, tmp_path: Path) -> None:
    """The GPU holds two children at the config's ctx but not one at the asked ctx, even
    alone: the load is a 503 that says what it needs, and the idle model on the GPU stays."""
    from fake_gpu import write as write_gpu

    from corral.supervisor.memory.estimate import estimate, model_facts

    model = write_tiny_llama(tmp_path / "tiny.gguf", 1, n_head=2)

    def gpu0_mib(ctx: int) -> float:
        est = estimate(model_facts(model), ctx=ctx, parallel=1, n_gpu_layers=-1,
                       cache_type_k="f16", cache_type_v="f16", gpus=["gpu0"])
        return est.devices["gpu0"] / (1024 * 1024)

    small, big = gpu0_mib(1024), gpu0_mib(262144)
    total = (2 * small + 100) * 100 / 85
    assert big > total > total * 0.85 > 2 * small
    gpu = tmp_path / "gpu.json"
    write_gpu(gpu, total_mb=total, others_mb=0, per_child_mb=10)
    corral = start_corral({
        "defaults": {"ctx": 1024, "prompt_cache": False},
        "policy": {"max_loaded": 4, "evict_timeout": 2},
        "memory": {"interval": 0.2, "reserve_mb": 0, "low_watermark": 85,
                   "critical_watermark": 95, "gpu_reader": f"plugin:{FAKE_GPU}:FileGpu",
                   "gpu_reader_options": {"path": str(gpu)}},
        "models": {"tiny": {"model": str(model), "load_overrides": {"max_ctx": 262144}},
                   "other": {"model": str(model)}},
    })
    corral.expect(allow="cannot start tiny")
    assert load(corral, "other").status_code == 200
    other = corral.model("other")["pid"]
    answer = load(corral, "tiny", {"ctx": 262144})
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "no_capacity" and "gpu0" in error["message"], error
    assert corral.model("other")["pid"] == other and corral.model("other")["state"] == "ready"
    assert corral.model("tiny")["state"] == "stopped"
    assert not [e for e in corral.log_events("instance.stop") if e.get("model") == "other"]
    # At the config's ctx it fits beside other.
    assert load(corral, "tiny").status_code == 200
    assert corral.model("other")["pid"] == other


def test_the_router_shaped_load_does_not_ignore_overrides(corral: Corral):
    """POST /models/load (llama.cpp's router shape, open to user keys) takes no overrides:
    a body with one is a 400 naming it, not a 200 that loads the config's settings."""
    for key in (USER_KEY, ADMIN_KEY):
        answer = corral.http.post("/models/load", json={"model": "tiny", "ctx": 4096},
                                  headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "ctx" and "/admin/models/tiny/load" in error["message"]
    assert corral.model("tiny")["state"] == "stopped"
    plain = corral.http.post("/models/load", json={"model": "tiny"})
    assert plain.status_code == 200, plain.text
    wait_until(lambda: corral.model("tiny")["state"] == "ready", timeout=30)


def test_a_restart_during_a_reloads_switch_over_keeps_the_new_config(
        start_corral: CorralFactory, tmp_path: Path, gate: Gate) -> None:
    """A reload changes tiny's ctx: its new child starts beside the old one (blue/green) and
    is held starting. An admin load with restart: true meanwhile replaces the switch-over;
    the child it starts must run the new config (with the load's overrides), and so must
    every later start: the reload is not undone."""
    model = str(write_tiny_llama(tmp_path / "tiny.gguf", 1, n_head=2))

    def cfg(ctx: int) -> dict[str, Any]:
        return {"defaults": {"prompt_cache": False}, "policy": {"max_loaded": 4},
                "models": {"tiny": {"model": model, "ctx": ctx, "binary": str(gate.binary)}}}
    corral = start_corral(cfg(1024))
    old = load(corral, "tiny").json()["pid"]
    gate.hold_starts()
    try:
        corral.reload_with(cfg(512))
        wait_until(gate.started.exists, timeout=20)
        assert corral.model("tiny")["model_state"] == "switching"
        thread, out = in_background(lambda: load(corral, "tiny",
                                                 {"parallel": 2, "restart": True}))
        wait_until(lambda: corral.model("tiny")["model_state"] != "switching", timeout=20)
    finally:
        gate.open()
    thread.join(60)
    answer = out[0]
    assert answer.status_code == 200, answer.text
    shown = answer.json()
    assert shown["pid"] != old and shown["overrides"] == {"parallel": 2}
    argv = argv_of(shown["pid"])
    assert (flag(argv, "--ctx-size"), flag(argv, "--parallel")) == ("512", "2")
    # And the next start, without overrides: the reloaded config still.
    assert corral.http.post("/admin/models/tiny/unload").status_code == 200
    again = load(corral, "tiny").json()
    assert flag(argv_of(again["pid"]), "--ctx-size") == "512" and again["ctx"] == 512


def test_an_unload_during_a_reloads_switch_over_keeps_the_new_config(
        start_corral: CorralFactory, tmp_path: Path, gate: Gate) -> None:
    """The same switch-over, dropped by an unload: the next load runs the reloaded config."""
    model = str(write_tiny_llama(tmp_path / "tiny.gguf", 1, n_head=2))

    def cfg(ctx: int) -> dict[str, Any]:
        return {"defaults": {"prompt_cache": False}, "policy": {"max_loaded": 4},
                "models": {"tiny": {"model": model, "ctx": ctx, "binary": str(gate.binary)}}}
    corral = start_corral(cfg(1024))
    assert load(corral, "tiny").status_code == 200
    gate.hold_starts()
    try:
        corral.reload_with(cfg(512))
        wait_until(gate.started.exists, timeout=20)
        assert corral.model("tiny")["model_state"] == "switching"
        assert corral.http.post("/admin/models/tiny/unload").status_code == 200
    finally:
        gate.open()
    wait_until(lambda: corral.model("tiny")["state"] == "stopped")
    again = load(corral, "tiny").json()
    assert flag(argv_of(again["pid"]), "--ctx-size") == "512" and again["ctx"] == 512


@pytest.mark.expect_log("instance.health_failed")
def test_replicas_run_the_same_settings(start_corral: CorralFactory, tmp_path: Path,
                                        gate: Gate) -> None:
    """A model with two replicas loaded with overrides: both children run them, and one that
    dies is replaced with them while its sibling still runs them (never a model whose
    replicas answer with different contexts)."""
    model = str(write_tiny_llama(tmp_path / "tiny.gguf", 1, n_head=2))
    corral = start_corral({"defaults": {"prompt_cache": False, "ctx": 1024},
                           "models": {"tiny": {"model": model, "replicas": 2}}})
    answer = load(corral, "tiny", {"ctx": 2048})
    assert answer.status_code == 200, answer.text

    def replicas() -> dict[str, dict[str, Any]]:
        rows = corral.http.get("/admin/models").json()["models"]
        return {m["name"]: m for m in rows if m["name"].startswith("tiny")}
    wait_until(lambda: [m["state"] for m in replicas().values()] == ["ready", "ready"],
               timeout=30)
    assert [m["ctx"] for m in replicas().values()] == [2048, 2048]
    second = replicas()["tiny#2"]["pid"]
    os.kill(second, signal.SIGKILL)
    wait_until(lambda: replicas()["tiny#2"]["pid"] != second, timeout=30)
    # The next request replaces it (replicas.min): with the overrides its sibling runs.
    assert corral.chat("tiny", max_tokens=2).status_code == 200
    wait_until(lambda: replicas()["tiny#2"]["state"] == "ready", timeout=30)
    shown = replicas()["tiny#2"]
    assert (shown["ctx"], shown["overrides"]) == (2048, {"ctx": 2048})
    assert flag(argv_of(shown["pid"]), "--ctx-size") == "2048"
