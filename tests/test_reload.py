"""Live reload: the plan (pure, unit-tested) and a real corral applying it to real children.

Triggers: the config file (and its includes) changing on disk, SIGHUP, POST /admin/reload.
Most end-to-end tests share one corral (each starts from the same base config, written and
applied by the `corral` fixture); the reload storm gets a daemon of its own."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from corral.supervisor.config import LoadedConfig, parse_config
from corral.supervisor.reload import REDACTED, config_view, diff

from conftest import Corral, CorralFactory, declared, tiny_config, wait_until

# -- the plan ------------------------------------------------------------------------------------

BASE = """\
defaults: {ttl: 300, ctx: 2048}
policy: {max_loaded: 3}
models:
  a: {model: a.gguf, aliases: [alpha]}
  b: {model: b.gguf, ctx: 4096}
  c: {model: c.gguf, threads: 2}
"""


def _loaded(text: str = BASE, **patch: Any) -> LoadedConfig:
    data = yaml.safe_load(text)
    for path, value in patch.items():
        *parents, last = path.split("__")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return parse_config(yaml.safe_dump(data), source=Path("/etc/corral/corral.yaml"))


def test_same_config_keeps_everything():
    plan = diff(_loaded(), _loaded())
    assert plan.empty and plan.keep == ("a", "b", "c")


@pytest.mark.parametrize(("path", "value"), [
    ("models__a__ttl", 60), ("models__a__aliases", ["alpha", "first"]),
    ("models__a__max_queue", 3), ("models__a__queue_timeout", 9.5),
    ("models__a__stop_grace", 1), ("models__a__start_timeout", 30),
    ("models__a__first_byte_timeout", 30), ("models__a__idle_timeout", 30),
    ("models__a__health_interval", 1), ("models__a__health_failures", 9),
    ("models__a__start_backoff", 0),
])
def test_settings_the_child_was_not_started_with_update_in_place(path, value):
    plan = diff(_loaded(), _loaded(**{path: value}))
    assert [c.name for c in plan.update] == ["a"] and not plan.replace
    assert plan.update[0].fields == (path.split("__")[-1],)
    assert plan.update[0].spec.name == "a" and set(plan.keep) == {"b", "c"}


@pytest.mark.parametrize(("path", "value"), [
    ("models__a__ctx", 4096), ("models__a__parallel", 2), ("models__a__model", "other.gguf"),
    ("models__a__args", ["--flash-attn", "on"]), ("models__a__env", {"X": "1"}),
    ("models__a__binary", "/opt/llama-server"), ("models__a__n_gpu_layers", 0),
    ("models__a__cache_type_k", "q8_0"), ("models__a__embeddings", True),
    ("models__a__mmproj", "proj.gguf"), ("models__c__threads", 3),
])
def test_settings_in_the_childs_argv_or_env_replace_it(path, value):
    plan = diff(_loaded(), _loaded(**{path: value}))
    name = path.split("__")[1]
    assert [c.name for c in plan.replace] == [name] and not plan.update


def test_defaults_reach_only_the_models_that_inherit_them():
    plan = diff(_loaded(), _loaded(defaults__ctx=1024, defaults__ttl=30))
    # a inherits both (ctx restarts it); b sets its own ctx (ttl only: live); c inherits both.
    assert {c.name: c.fields for c in plan.replace} == {"a": ("ttl", "ctx"), "c": ("ttl", "ctx")}
    assert {c.name: c.fields for c in plan.update} == {"b": ("ttl",)}


def test_added_and_removed_models():
    plan = diff(_loaded(), _loaded(models__b=None, models__d={"model": "d.gguf"}))
    assert plan.remove == ("b",) and [c.name for c in plan.add] == ["d"]
    assert plan.summary()["added"] == ["d"] and plan.summary()["removed"] == ["b"]


def test_policy_change_restarts_nothing_even_though_automatic_threads_follow_it(monkeypatch):
    # Eight cores, whatever this machine has: the automatic thread count (cores / max_loaded)
    # must move with max_loaded for the test to ask anything.
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    old, new = _loaded(), _loaded(policy__max_loaded=1)
    assert old.models["a"].threads != new.models["a"].threads
    plan = diff(old, new)
    assert not plan.replace and plan.settings == ("policy",)
    # a and b had automatic threads: the new count applies at their next start.
    assert {c.name for c in plan.update} == {"a", "b"} and "c" in plan.keep


def test_live_top_level_settings_and_those_that_need_a_restart():
    plan = diff(_loaded(), _loaded(api_keys=["k"], groups={"g": {"models": ["a", "b"]}},
                                   listen="127.0.0.1:9999", max_body_mb=1))
    assert set(plan.settings) == {"api_keys", "groups"}
    assert set(plan.needs_restart) == {"listen", "max_body_mb"}
    assert plan.keep == ("a", "b", "c") and not plan.update and not plan.replace


def test_pinning_is_reported_both_ways():
    pinned = {"g": {"models": ["a", "c"], "pinned": True}}
    plan = diff(_loaded(), _loaded(groups=pinned))
    assert plan.pinned == ("a", "c") and not plan.unpinned
    plan = diff(_loaded(groups=pinned), _loaded(models__c=None, groups={}))
    assert plan.unpinned == ("a",) and plan.remove == ("c",)  # a removed model is just removed


def test_config_view_redacts_keys_and_env_values():
    view = config_view(_loaded(api_keys=["sk-1", "sk-2"], admin_api_keys=["adm"],
                               models__a__env={"HF_TOKEN": "secret"}))
    assert view["config"]["api_keys"] == [REDACTED, REDACTED]
    assert view["config"]["admin_api_keys"] == [REDACTED]
    assert view["config"]["models"]["a"]["env"] == {"HF_TOKEN": REDACTED}
    assert "secret" not in repr(view) and "sk-1" not in repr(view)
    assert view["models"] == ["a", "b", "c"] and view["hash"].startswith("sha256:")


# -- the daemon's side, in-process (no children) --------------------------------------------

def test_reloads_serialize_and_a_cancelled_caller_does_not_stop_one(tmp_path):
    from corral.supervisor.daemon import Daemon

    texts = iter([BASE.replace("ttl: 300", "ttl: 1"), BASE.replace("ttl: 300", "ttl: 2")])
    calls: list[tuple[str, float, float]] = []

    reading = threading.Event()

    def slow_loader() -> LoadedConfig:
        began = time.monotonic()
        reading.set()
        text = next(texts)
        time.sleep(0.2)  # a large config, a slow disk
        calls.append((text, began, time.monotonic()))
        return parse_config(text, source=tmp_path / "c.yaml")

    async def scenario() -> None:
        daemon = Daemon(parse_config(BASE, source=tmp_path / "c.yaml"),
                        tmp_path / "children.json", config_loader=slow_loader)
        first = daemon.reload("admin")
        waiter = asyncio.ensure_future(asyncio.shield(first))
        second = daemon.reload("sighup")
        while not reading.is_set():  # the first reload is under way
            await asyncio.sleep(0.01)
        waiter.cancel()  # the HTTP client hung up
        attempts = await asyncio.gather(first, second)
        assert [a.ok for a in attempts] == [True, True]
        assert calls[1][1] >= calls[0][2]  # the second read began after the first ended
        assert daemon.models["a"].spec.ttl == 2  # both applied, in order
        assert daemon.last_reload is attempts[1] and attempts[1].trigger == "sighup"
        assert attempts[0].changes is not None and attempts[0].changes["updated"] == {
            "a": ["ttl"], "b": ["ttl"], "c": ["ttl"]}

    asyncio.run(scenario())


def test_a_reload_cancelled_mid_read_still_says_how_it_ended(tmp_path):
    from corral.supervisor.daemon import Daemon

    reading = threading.Event()

    def slow_loader() -> LoadedConfig:
        reading.set()
        time.sleep(0.3)
        return parse_config(BASE, source=tmp_path / "c.yaml")

    async def scenario() -> None:
        daemon = Daemon(parse_config(BASE, source=tmp_path / "c.yaml"),
                        tmp_path / "children.json", config_loader=slow_loader)
        sub = daemon.events.subscribe(kinds=frozenset({"reloading", "reload"}))
        task = daemon.reload("file")
        while not reading.is_set():  # mid-read: the loader has begun
            await asyncio.sleep(0.01)
        task.cancel()  # the daemon shutting down cancels the tasks it owns
        with pytest.raises(asyncio.CancelledError):
            await task
        kinds = [(e.kind, e.data.get("ok")) for e in sub.pending()]
        assert kinds == [("reloading", None), ("reload", False)], kinds
        assert daemon.last_reload is not None and not daemon.last_reload.ok
        assert "shutting down" in daemon.last_reload.issues[0].message

    asyncio.run(scenario())


def test_a_group_hold_is_given_back_after_a_reload_removed_its_model(tmp_path):
    from corral.supervisor.daemon import Daemon

    async def scenario() -> None:
        daemon = Daemon(_loaded(), tmp_path / "children.json",
                        config_loader=lambda: _loaded(models__b=None))
        with daemon.reserve(["alpha", "b"]):
            b = daemon.herd.instance("b")
            assert b.held == 1
            attempt = await daemon.reload("admin")
            assert attempt.ok and attempt.changes and attempt.changes["removed"] == ["b"]
            assert "b" not in daemon.models and daemon.resolve("b") is None
        assert b.held == 0 and daemon.herd.instance("a").held == 0

    asyncio.run(scenario())


# -- end to end ----------------------------------------------------------------------------------

LONG_STREAM = {"stream": True, "max_tokens": 3500, "ignore_eos": True,
               "stream_options": {"include_usage": True}}
ENV = "CORRAL_RELOAD_TEST_MODELS"


def admin_config(corral: Corral) -> dict[str, Any]:
    data: dict[str, Any] = corral.http.get("/admin/config").json()
    return data


def write(path: Path, data: dict[str, Any] | str, atomic: bool = False) -> float:
    """Write a config as an editor would (in place, or a new file renamed over the old);
    returns the time just before, for wait_reload."""
    text = data if isinstance(data, str) else yaml.safe_dump(data)
    before = time.time()
    if atomic:
        tmp = path.with_name(path.name + ".swp")
        tmp.write_text(text)
        os.replace(tmp, path)
    else:
        path.write_text(text)
    return before


def wait_reload(corral: Corral, since: float, timeout: float = 15,
                noop: bool = False) -> dict[str, Any]:
    """The first reload attempt that finished after `since` (wall clock), one that failed or
    changed something unless `noop`: a reload that changed nothing may come from the write
    before (its file's stamps looked at again after its own reload read it)."""
    def attempt() -> dict[str, Any] | None:
        recent = admin_config(corral)["recent_reloads"]
        return next((a for a in recent if a["at"] > since
                     and (noop or not a["ok"] or _changed(a["changes"]))), None)
    result: dict[str, Any] = wait_until(attempt, timeout=timeout, interval=0.02)
    return result


def _changed(changes: dict[str, Any]) -> bool:
    return any(value for key, value in changes.items() if key != "unchanged")


def settle(corral: Corral, quiet: float = 0.5) -> None:
    """Until no reload has happened for `quiet` seconds (a watcher's echo of a write included),
    so the next attempt a test waits for is its own."""
    def calm() -> bool:
        recent = admin_config(corral)["recent_reloads"]
        return not recent or time.time() - recent[-1]["at"] > quiet
    wait_until(calm, timeout=20, interval=0.05)


def sse(text: str) -> list[Any]:
    import json

    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            try:
                out.append(json.loads(data))
            except ValueError:
                out.append(data)
    return out


def whole_stream(resp: httpx.Response, tokens: int) -> bool:
    """A 200 stream that ended in [DONE] after all `tokens`, with no error event."""
    if resp.status_code != 200:
        return False
    events = sse(resp.text)
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    return (bool(events) and events[-1] == "[DONE]"
            and not any(isinstance(e, dict) and "error" in e for e in events)
            and bool(usage) and usage[-1]["completion_tokens"] == tokens)


def in_background(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


class Setup:
    """The shared daemon's files: main config, an included file, a discovery folder."""

    def __init__(self, folder: Path, tiny_models: dict[str, Path]):
        self.tiny_models = tiny_models
        self.folder = folder
        self.extra = folder / "extra.yaml"
        self.found = folder / "found"
        self.found.mkdir()

    def main(self) -> dict[str, Any]:
        config = tiny_config(self.tiny_models, names=["tiny-a", "tiny-b"],
                             shutdown_grace=120, policy={"max_loaded": 4})
        config["include"] = ["extra.yaml"]
        config["models_dir"] = str(self.found)
        return config

    def extra_config(self, ttl: float = 300) -> dict[str, Any]:
        # ${VAR} in an included file: the daemon's environment has it.
        return {"models": {"tiny-c": {"model": f"${{{ENV}}}/tiny-c.gguf", "ctx": 8192,
                                      "ttl": ttl}}}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path],
           request: pytest.FixtureRequest) -> Any:
    folder = tmp_path_factory.mktemp("reload")
    setup = Setup(folder, tiny_models)
    setup.extra.write_text(yaml.safe_dump(setup.extra_config()))
    os.environ[ENV] = str(tiny_models["tiny-c"].parent)
    factory = CorralFactory(folder, declared(request))
    try:
        corral = factory(setup.main())
        yield corral, setup
    finally:
        os.environ.pop(ENV, None)
        factory.close()


@pytest.fixture
def corral(shared: tuple[Corral, Setup]) -> tuple[Corral, Setup]:
    """The shared daemon running the base config (whatever the test before left behind)."""
    corral, setup = shared
    for path in setup.found.iterdir():
        path.unlink()
    written = None
    for path, data in ((setup.extra, setup.extra_config()), (corral.config_path, setup.main())):
        text = yaml.safe_dump(data)
        if path.read_text() != text:
            at = write(path, text)
            written = at if written is None else written
    if written is not None:
        # The watcher's own reload of the rewrite comes first (it may change nothing: the
        # file was broken, the config running is the one written back).
        wait_reload(corral, written, noop=True)
    resp = corral.http.post("/admin/reload")
    assert resp.status_code == 200, resp.text
    wait_until(lambda: all(m["state"] in ("ready", "stopped") for m in corral.models().values()),
               timeout=60)
    settle(corral)
    return corral, setup


def _untouched(corral: Corral, pids: dict[str, int], spawned: dict[str, int]) -> None:
    for name, pid in pids.items():
        assert corral.model(name)["pid"] == pid, name
        assert len(corral.spawned(name)) == spawned[name], name


def _loaded_now(corral: Corral, names: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    for name in names:
        assert corral.chat(name, max_tokens=1).status_code == 200
    return ({n: corral.model(n)["pid"] for n in names},
            {n: len(corral.spawned(n)) for n in names})


def test_file_edit_applies_ttl_and_aliases_live_keeping_the_child(corral):
    corral, setup = corral
    pids, spawned = _loaded_now(corral, ["tiny-a", "tiny-b"])
    config = setup.main()
    config["models"]["tiny-a"].update(ttl=900, aliases=["alpha"])
    attempt = wait_reload(corral, write(corral.config_path, config))
    assert attempt["ok"] and attempt["trigger"] == "file", attempt
    assert attempt["changes"]["updated"] == {"tiny-a": ["aliases", "ttl"]}
    assert attempt["changes"]["restarted"] == {}
    state = corral.model("tiny-a")
    assert state["ttl"] == 900 and state["aliases"] == ["alpha"]
    assert corral.chat("alpha", max_tokens=1).status_code == 200  # the new alias routes
    # Saved the way most editors save: a new file renamed over the old one.
    config["models"]["tiny-a"]["ttl"] = 901
    attempt = wait_reload(corral, write(corral.config_path, config, atomic=True))
    assert attempt["ok"] and corral.model("tiny-a")["ttl"] == 901
    _untouched(corral, pids, spawned)


def test_live_settings_touch_no_child_api_keys_groups_policy(corral):
    corral, setup = corral
    pids, spawned = _loaded_now(corral, ["tiny-a", "tiny-b"])
    config = setup.main()
    config.update(api_keys=[corral.api_key], policy={"max_loaded": 3},
                  groups={"duo": {"models": ["tiny-a", "tiny-b"], "expose_as_model": True}})
    attempt = wait_reload(corral, write(corral.config_path, config))
    assert set(attempt["changes"]["settings"]) == {"api_keys", "groups", "policy"}, attempt
    anonymous = httpx.post(corral.url + "/v1/chat/completions", json={"model": "tiny-a"})
    assert anonymous.status_code == 401  # the new key is required at once
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200  # and accepted
    listed = [m["id"] for m in corral.http.get("/v1/models").json()["data"]]
    assert "duo" in listed
    shown = admin_config(corral)["active"]["config"]
    assert shown["api_keys"] == [REDACTED] and corral.api_key not in str(shown)
    del config["api_keys"]
    wait_reload(corral, write(corral.config_path, config))
    ok = httpx.post(corral.url + "/v1/chat/completions",
                    json={"model": "tiny-a", "max_tokens": 1,
                          "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200  # open again
    _untouched(corral, pids, spawned)


def test_sighup_reloads(corral):
    corral, setup = corral
    pids, spawned = _loaded_now(corral, ["tiny-a"])
    (setup.found / "tiny-a2.gguf").symlink_to(setup.tiny_models["tiny-a2"])
    since = time.time()
    corral.proc.send_signal(signal.SIGHUP)  # the file did not change: only SIGHUP reloads
    attempt = wait_reload(corral, since)
    assert attempt["ok"] and attempt["trigger"] == "sighup"
    assert attempt["changes"]["added"] == ["tiny-a2"]
    assert corral.chat("tiny-a2", max_tokens=1).status_code == 200
    _untouched(corral, pids, spawned)


def test_admin_reload_answers_with_what_changed(corral):
    corral, setup = corral
    (setup.found / "tiny-a2.gguf").symlink_to(setup.tiny_models["tiny-a2"])
    resp = corral.http.post("/admin/reload")
    assert resp.status_code == 200
    body = resp.json()
    assert body["ok"] and body["trigger"] == "admin" and body["issues"] == []
    assert body["changes"]["added"] == ["tiny-a2"] and body["changes"]["removed"] == []
    assert body["hash"] == admin_config(corral)["active"]["hash"]
    again = corral.http.post("/admin/reload").json()
    assert again["ok"] and again["changes"]["added"] == [] and again["changes"]["updated"] == {}
    assert again["changes"]["unchanged"] == len(corral.models())


def _streaming_with_one_queued(corral: Corral) -> tuple[Any, ...]:
    """tiny-a and tiny-b loaded, a long stream on tiny-a's only slot and one more request
    queued behind it: (pids, spawned, stream, result, queued, queued_result)."""
    pids, spawned = _loaded_now(corral, ["tiny-a", "tiny-b"])
    stream, result = in_background(lambda: corral.http.post(
        "/v1/chat/completions", json={"model": "tiny-a", "messages": [
            {"role": "user", "content": "go"}], **LONG_STREAM}, timeout=120))
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 1)
    queued, queued_result = in_background(lambda: corral.chat("tiny-a", max_tokens=2))
    wait_until(lambda: corral.model("tiny-a")["queue"] == 1)
    return pids, spawned, stream, result, queued, queued_result


def test_ctx_change_switches_to_a_new_child_while_the_old_one_finishes(corral):
    """Blue/green: with room for both, the new child starts beside the old one, which keeps
    serving; once ready it takes the name, and the old one drains its stream."""
    corral, setup = corral
    pids, spawned, stream, result, queued, queued_result = _streaming_with_one_queued(corral)
    config = setup.main()
    config["models"]["tiny-a"]["ctx"] = 4096
    attempt = wait_reload(corral, write(corral.config_path, config))
    assert attempt["changes"]["restarted"] == {"tiny-a": ["ctx"]}, attempt
    # The new child serves both requests while the old one's stream is still running.
    waiting = corral.chat("tiny-a", max_tokens=2)
    assert waiting.status_code == 200, waiting.text
    queued.join(120)
    assert queued_result[0].status_code == 200, queued_result[0].text
    assert stream.is_alive(), "the switch should not have waited for the stream"
    events = corral.spawned("tiny-a")
    assert corral.model("tiny-a")["pid"] == events[-1]["pid"] != pids["tiny-a"]
    stream.join(120)
    assert whole_stream(result[0], LONG_STREAM["max_tokens"]), result[0].text[-300:]
    assert len(corral.spawned("tiny-a")) == spawned["tiny-a"] + 1  # exactly one new child...
    argv = events[-1]["argv"]
    assert argv[argv.index("--ctx-size") + 1] == "4096"  # ...with the new settings
    stops = [e for e in corral.log_events("instance.stop") if e["model"] == "tiny-a"]
    assert stops[-1]["reason"] == "replaced by its new child (config changed: ctx)"
    assert stops[-1]["pid"] == pids["tiny-a"]
    assert corral.log_events("daemon.switched_over")[-1]["old_pid"] == pids["tiny-a"]
    assert wait_until(lambda: not same_pid_running(pids["tiny-a"]), timeout=20)
    _untouched(corral, {"tiny-b": pids["tiny-b"]}, {"tiny-b": spawned["tiny-b"]})


@pytest.mark.expect_log("daemon.switch_over_failed")
def test_a_new_child_that_fails_to_start_leaves_the_old_one_serving(corral):
    corral, setup = corral
    pids, spawned = _loaded_now(corral, ["tiny-a"])
    config = setup.main()
    config["models"]["tiny-a"]["args"] = ["--no-such-flag"]
    attempt = wait_reload(corral, write(corral.config_path, config))
    assert attempt["changes"]["restarted"] == {"tiny-a": ["args"]}, attempt
    assert wait_until(lambda: corral.log_events("daemon.switch_over_failed"), timeout=20)
    model = corral.model("tiny-a")
    assert model["pid"] == pids["tiny-a"] and model["state"] == "ready"
    assert "failed to start" in model["last_error"]
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200
    assert len(corral.spawned("tiny-a")) == spawned["tiny-a"] + 1  # the one failed try


def test_ctx_change_without_room_for_both_restarts_in_place(corral):
    corral, setup = corral
    pids, spawned, stream, result, queued, queued_result = _streaming_with_one_queued(corral)
    config = setup.main()
    config["models"]["tiny-a"]["ctx"] = 4096
    config["policy"]["max_loaded"] = 2  # full: no room for a second tiny-a child
    attempt = wait_reload(corral, write(corral.config_path, config))
    assert attempt["changes"]["restarted"] == {"tiny-a": ["ctx"]}, attempt
    assert corral.model("tiny-a")["state"] == "draining"
    # A new request waits for the new child instead of failing; so does the queued one.
    waiting = corral.chat("tiny-a", max_tokens=2)
    assert waiting.status_code == 200, waiting.text
    queued.join(120)
    assert queued_result[0].status_code == 200, queued_result[0].text
    stream.join(120)
    assert whole_stream(result[0], LONG_STREAM["max_tokens"]), result[0].text[-300:]
    events = corral.spawned("tiny-a")
    assert len(events) == spawned["tiny-a"] + 1  # exactly one new child...
    argv = events[-1]["argv"]
    assert argv[argv.index("--ctx-size") + 1] == "4096"  # ...with the new settings
    assert corral.model("tiny-a")["pid"] == events[-1]["pid"] != pids["tiny-a"]
    # The stop drained: it began after the stream's request and ended after it finished.
    stops = [e for e in corral.log_events("instance.stop") if e["model"] == "tiny-a"]
    assert stops[-1]["reason"] == "config changed: ctx" and stops[-1]["pid"] == pids["tiny-a"]
    _untouched(corral, {"tiny-b": pids["tiny-b"]}, {"tiny-b": spawned["tiny-b"]})


def same_pid_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_parallel_change_restarts_with_new_slots(corral):
    corral, setup = corral
    pids, _ = _loaded_now(corral, ["tiny-b"])
    config = setup.main()
    config["models"]["tiny-b"]["parallel"] = 2
    attempt = wait_reload(corral, write(corral.config_path, config))
    assert attempt["changes"]["restarted"] == {"tiny-b": ["parallel"]}
    # Switched over to the new child (blue/green): its pid under the model's name.
    wait_until(lambda: (lambda m: m["state"] == "ready" and m["pid"] not in (
        pids["tiny-b"], None))(corral.model("tiny-b")), timeout=30)
    body = {"model": "tiny-b", "messages": [{"role": "user", "content": "go"}], **LONG_STREAM}
    runs = [in_background(lambda: corral.http.post("/v1/chat/completions", json=body,
                                                   timeout=120)) for _ in range(2)]
    # Both run at once on the new child's two slots.
    wait_until(lambda: corral.model("tiny-b")["in_flight"] == 2, timeout=30)
    for thread, result in runs:
        thread.join(120)
        assert whole_stream(result[0], LONG_STREAM["max_tokens"])


def test_removed_model_drains_then_is_gone_with_404(corral):
    corral, setup = corral
    pids, _ = _loaded_now(corral, ["tiny-a", "tiny-b"])
    stream, result = in_background(lambda: corral.http.post(
        "/v1/chat/completions", json={"model": "tiny-b", "messages": [
            {"role": "user", "content": "go"}], **LONG_STREAM}, timeout=120))
    wait_until(lambda: corral.model("tiny-b")["in_flight"] == 1)
    config = setup.main()
    del config["models"]["tiny-b"]
    attempt = wait_reload(corral, write(corral.config_path, config))
    assert attempt["changes"]["removed"] == ["tiny-b"]
    gone = corral.chat("tiny-b", max_tokens=1)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert "tiny-b" not in corral.models()
    assert corral.http.post("/admin/models/tiny-b/load").status_code == 404
    stream.join(120)
    assert whole_stream(result[0], LONG_STREAM["max_tokens"])  # the one in flight finished
    wait_until(lambda: pids["tiny-b"] not in corral.child_pids(), timeout=30)
    assert corral.model("tiny-a")["pid"] == pids["tiny-a"]


@pytest.mark.expect_log("daemon.reload_failed")
def test_broken_yaml_keeps_the_running_config_and_shows_file_and_line(corral):
    corral, setup = corral
    pids, spawned = _loaded_now(corral, ["tiny-a"])
    active = admin_config(corral)["active"]
    text = yaml.safe_dump(setup.main()).replace("ttl: 300", "ttl: [300")
    attempt = wait_reload(corral, write(corral.config_path, text))
    assert not attempt["ok"] and attempt["trigger"] == "file"
    issue = attempt["issues"][0]
    assert issue["file"] == str(corral.config_path) and issue["line"] > 1, issue
    assert "invalid YAML" in issue["message"]
    status = admin_config(corral)
    assert status["active"]["hash"] == active["hash"]  # the running config stays
    assert status["active"]["config"] == active["config"]
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200  # nothing fails
    failed = [e for e in corral.log_events("daemon.reload_failed")]
    assert failed and str(corral.config_path) in failed[-1]["issues"][0]
    # A config that parses but is wrong: the key and its line.
    text = yaml.safe_dump(setup.main()).replace("ttl: 300", "tll: 300")
    write(corral.config_path, text)
    resp = corral.http.post("/admin/reload")
    assert resp.status_code == 422
    body = resp.json()
    assert body["error"]["code"] == "invalid_config" and not body["ok"]
    line = text.splitlines().index("  tll: 300") + 1
    assert body["issues"][0]["text"] == (f"{corral.config_path}:{line}: defaults.tll: "
                                         "Extra inputs are not permitted")
    _untouched(corral, pids, spawned)


@pytest.mark.expect_log("daemon.reload_failed")
def test_a_save_in_place_caught_empty_is_read_again_and_a_file_left_empty_is_refused(corral):
    corral, setup = corral
    pids, spawned = _loaded_now(corral, ["tiny-a"])
    config = setup.main()
    config["models"]["tiny-a"]["ttl"] = 301
    text = yaml.safe_dump(config)
    # An editor saving in place: truncated, then written a moment later (here 0.2 s, far longer
    # than a real save, so the watcher sees the empty file for sure).
    since = write(corral.config_path, "")
    time.sleep(0.2)
    corral.config_path.write_text(text)
    attempt = wait_reload(corral, since)
    assert attempt["ok"], attempt
    assert admin_config(corral)["active"]["config"]["models"]["tiny-a"]["ttl"] == 301
    settle(corral)
    assert all(a["ok"] for a in admin_config(corral)["recent_reloads"] if a["at"] > since)
    # Left empty: refused after the grace, with a word on how to remove every model.
    active = admin_config(corral)["active"]
    attempt = wait_reload(corral, write(corral.config_path, ""))
    assert not attempt["ok"] and "config file is empty" in attempt["issues"][0]["message"]
    assert "models: {}" in attempt["issues"][0]["message"]
    assert admin_config(corral)["active"]["hash"] == active["hash"]
    _untouched(corral, pids, spawned)


@pytest.mark.expect_log("daemon.reload_failed")
def test_included_file_is_watched_and_its_errors_name_it(corral):
    corral, setup = corral
    pids, spawned = _loaded_now(corral, ["tiny-a", "tiny-c"])
    status = admin_config(corral)["active"]
    assert status["files"] == [str(corral.config_path), str(setup.extra)]
    attempt = wait_reload(corral, write(setup.extra, setup.extra_config(ttl=77)))
    assert attempt["ok"] and attempt["changes"]["updated"] == {"tiny-c": ["ttl"]}, attempt
    assert corral.model("tiny-c")["ttl"] == 77
    broken = yaml.safe_dump(setup.extra_config()).replace("ctx:", "kontext:")
    attempt = wait_reload(corral, write(setup.extra, broken))
    assert not attempt["ok"]
    line = broken.splitlines().index("    kontext: 8192") + 1
    assert attempt["issues"][0]["text"] == (f"{setup.extra}:{line}: models.tiny-c.kontext: "
                                            "Extra inputs are not permitted")
    assert corral.model("tiny-c")["ttl"] == 77
    _untouched(corral, pids, spawned)


@pytest.mark.expect_log("daemon.reload_failed")
def test_an_included_file_caught_empty_is_read_again_and_one_left_empty_is_refused(corral):
    """An editor saving an included file in place truncates it, then writes: a reload that
    caught it empty loaded it as holding nothing, and removed its models (drained, stopped),
    to add them again, new children, at the save's next write (CI's test-workers run caught
    one this way). It is read again for a moment, as the main file is; one left empty is
    refused, naming it, and `{}` empties it on purpose."""
    corral, setup = corral
    pids, spawned = _loaded_now(corral, ["tiny-a", "tiny-c"])
    since = write(setup.extra, "")
    time.sleep(0.2)  # far longer than a real save: the watcher sees the empty file for sure
    setup.extra.write_text(yaml.safe_dump(setup.extra_config(ttl=78)))
    attempt = wait_reload(corral, since)
    assert attempt["ok"] and attempt["changes"]["updated"] == {"tiny-c": ["ttl"]}, attempt
    settle(corral)
    assert all(a["ok"] and not a["changes"]["removed"]
               for a in admin_config(corral)["recent_reloads"] if a["at"] > since)
    assert corral.model("tiny-c")["ttl"] == 78
    _untouched(corral, pids, spawned)

    attempt = wait_reload(corral, write(setup.extra, ""))
    assert not attempt["ok"], attempt
    assert attempt["issues"][0]["message"].startswith(
        f"the included file {setup.extra} is empty; not applied"), attempt
    assert corral.model("tiny-c")["state"] == "ready"
    _untouched(corral, pids, spawned)

    attempt = wait_reload(corral, write(setup.extra, "{}\n"))
    assert attempt["ok"] and attempt["changes"]["removed"] == ["tiny-c"], attempt


def test_new_pinned_group_starts_its_models(corral):
    corral, setup = corral
    if corral.model("tiny-c")["state"] != "stopped":
        assert corral.http.post("/admin/models/tiny-c/unload").status_code == 200
    spawned = len(corral.spawned("tiny-c"))
    config = setup.main()
    config["groups"] = {"core": {"models": ["tiny-c"], "pinned": True}}
    attempt = wait_reload(corral, write(corral.config_path, config))
    assert attempt["changes"]["pinned"] == ["tiny-c"]
    wait_until(lambda: corral.model("tiny-c")["state"] == "ready", timeout=30)
    assert corral.model("tiny-c")["pinned"] and len(corral.spawned("tiny-c")) == spawned + 1


# -- the storm -----------------------------------------------------------------------------------

@pytest.mark.expect_log("daemon.reload_failed")
def test_reload_storm(start_corral: CorralFactory, tiny_models: dict[str, Path]):
    """50 edits in ~10 s (ttl changes, one ctx flip, one broken edit) while four streams and a
    request loop run: nothing fails, only the flipped model restarts, and only once."""
    names = ["tiny-a", "tiny-b", "tiny-c"]
    base = tiny_config(tiny_models, names=names, shutdown_grace=120, policy={"max_loaded": 3})
    corral = start_corral(base)
    pids, spawned = _loaded_now(corral, names)
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    failures: list[str] = []

    def streams(model: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "go"}],
                "stream": True, "max_tokens": 300, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=corral.url, timeout=120) as client:
            while not stop.is_set():
                resp = client.post("/v1/chat/completions", json=body)
                if whole_stream(resp, 300):
                    outcomes[f"stream {model}"] += 1
                else:
                    failures.append(f"stream {model}: {resp.status_code} {resp.text[-200:]}")

    def loop() -> None:
        with httpx.Client(base_url=corral.url, timeout=120) as client:
            i = 0
            while not stop.is_set():
                model = names[i % 3]
                i += 1
                resp = client.post("/v1/chat/completions", json={
                    "model": model, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}]})
                if resp.status_code == 200:
                    outcomes[f"request {model}"] += 1
                else:
                    failures.append(f"request {model}: {resp.status_code} {resp.text[-200:]}")

    workers = [threading.Thread(target=streams, args=(m,), daemon=True)
               for m in ["tiny-a", "tiny-a", "tiny-b", "tiny-c"]]
    workers.append(threading.Thread(target=loop, daemon=True))
    for worker in workers:
        worker.start()
    wait_until(lambda: sum(outcomes.values()) >= 4, timeout=60)

    edits, started = 50, time.monotonic()
    config = copy.deepcopy(base)
    broken_at, flip_at = 30, 20
    for i in range(edits):
        config = copy.deepcopy(base)
        config["models"]["tiny-a"]["ttl"] = 400 + i
        config["models"]["tiny-b"]["ttl"] = 600 + (i % 7)
        if i >= flip_at:
            config["models"]["tiny-c"]["ctx"] = 4096
        if i == broken_at:
            # The last edit applied first: its reload may still be running (this box has two
            # cores and five busy clients), and then it would be the attempt waited for below.
            last_ttl = config["models"]["tiny-a"]["ttl"] - 1
            wait_until(lambda: admin_config(corral)["active"]["config"]["models"]["tiny-a"]
                       ["ttl"] == last_ttl, timeout=15)  # noqa: B023 (called at once)
            settle(corral, quiet=0.3)
            good = admin_config(corral)["active"]
            attempt = wait_reload(corral, write(corral.config_path, "models:\n  tiny-a: [\n"))
            assert not attempt["ok"] and attempt["issues"][0]["line"] is not None
            after = admin_config(corral)["active"]
            assert after["hash"] == good["hash"] and after["config"] == good["config"]
            continue
        write(corral.config_path, config, atomic=i % 2 == 0)
        time.sleep(max(0.0, started + (i + 1) * 0.2 - time.monotonic()))
    final_ttl = config["models"]["tiny-a"]["ttl"]
    wait_until(lambda: admin_config(corral)["active"]["config"]["models"]["tiny-a"]["ttl"]
               == final_ttl, timeout=15)
    wait_until(lambda: corral.model("tiny-c")["state"] == "ready", timeout=60)
    time.sleep(1)  # the workers run on the settled config a moment
    stop.set()
    for worker in workers:
        worker.join(150)
    elapsed = time.monotonic() - started

    assert not failures, failures[:5]
    assert all(outcomes[f"stream {m}"] > 0 for m in names), outcomes
    status = admin_config(corral)
    assert status["last_reload"]["ok"]
    assert status["active"]["config"]["models"]["tiny-b"]["ttl"] == config["models"]["tiny-b"][
        "ttl"]
    # Unchanged models (ttl only) kept their children.
    _untouched(corral, {n: pids[n] for n in ["tiny-a", "tiny-b"]},
               {n: spawned[n] for n in ["tiny-a", "tiny-b"]})
    # The flipped one restarted exactly once, with the new ctx.
    events = corral.spawned("tiny-c")
    assert len(events) == spawned["tiny-c"] + 1, [e["argv"] for e in events]
    argv = events[-1]["argv"]
    assert argv[argv.index("--ctx-size") + 1] == "4096"
    assert len(corral.log_events("daemon.reload_failed")) >= 1
    reloads = corral.log_events("daemon.reload")
    print(f"storm: {edits} edits in {elapsed:.1f}s, {len(reloads)} reloads applied, "
          f"outcomes {dict(outcomes)}")
