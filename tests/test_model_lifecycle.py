"""The defects issue 34 found on running daemons, each on a whole daemon in-process over fake
upstream children (tests/fake_upstream.py). Each failed on e3e28ca."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from lifecycle_harness import config_text, running

from corral.supervisor.errors import QueueTimeout, Unloaded
from corral.supervisor.instance import State
from corral.supervisor.model import ModelState


def _models(tiny: dict[str, Path], **models: dict[str, Any]) -> dict[str, dict[str, Any]]:
    files = iter(["tiny-a", "tiny-b", "tiny-c", "tiny-a2"])
    return {name: {"model": str(tiny[next(files)]), **settings}
            for name, settings in models.items()}


def run(scenario: Any) -> None:
    asyncio.run(asyncio.wait_for(scenario, 120))


async def _stays_stopped(harness: Any, name: str, seconds: float = 1.5) -> None:
    """The model is stopped, and nothing brings it back for a while (the restart, the
    switch-over or the KV step it interrupted would have, within this time)."""
    await harness.until(lambda: harness.inst(name).state is State.STOPPED, what="stopped")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert harness.inst(name).state is State.STOPPED, harness.states()
        assert harness.daemon.herd.models[name].incoming is None, harness.states()
        await asyncio.sleep(0.05)
    assert harness.daemon.herd.models[name].state() is ModelState.STOPPED


def test_an_unload_during_an_in_place_restart_leaves_the_model_stopped(tiny_models, tmp_path):
    """e3e28ca: `corral stop m` while a reload restarts it in place answered 200, and the
    restart brought `m` back ready with a new pid."""
    # max_loaded 1: no room for a new child beside the old one, so the reload restarts it.
    models = _models(tiny_models, m={"stop_grace": 2})

    async def scenario() -> None:
        async with running(config_text(models, policy={"max_loaded": 1}), tmp_path) as h:
            await h.daemon.load("m")
            lease = await h.daemon.acquire("m")  # in flight: the restart drains first
            models["m"]["ctx"] = 1024
            await h.reload(config_text(models, policy={"max_loaded": 1}))
            assert h.daemon.herd.models["m"].state() is ModelState.RESTARTING
            unload = asyncio.ensure_future(h.daemon.unload("m", force=True))
            lease.release()
            status = await unload
            assert status.state is State.STOPPED
            await _stays_stopped(h, "m")

    run(scenario())


def test_an_unload_during_a_switch_over_leaves_the_model_stopped(tiny_models, tmp_path):
    """e3e28ca: the unload stopped the old child; the new one came up ready 0.5 s later."""
    models = _models(tiny_models, m={"env": {"FAKE_UPSTREAM_DELAY": "0.5"}})

    async def scenario() -> None:
        async with running(config_text(models), tmp_path) as h:
            await h.daemon.load("m")
            models["m"]["ctx"] = 1024
            await h.reload(config_text(models))
            model = h.daemon.herd.models["m"]
            assert model.state() is ModelState.SWITCHING and model.incoming is not None
            fresh = model.incoming
            await h.daemon.unload("m")
            await _stays_stopped(h, "m")
            await h.until(lambda: fresh.state is State.STOPPED, what="the new child stopped")

    run(scenario())


def test_an_unload_after_a_kv_step_leaves_the_model_stopped(tiny_models, tmp_path):
    """e3e28ca: the same once more after a KV step up: the restart undid the unload."""
    ladder = {"adaptive": True, "ladder": ["f16", "bf16", "f32"]}
    models = _models(tiny_models, m={"kv_cache": ladder, "stop_grace": 2})

    async def scenario() -> None:
        async with running(config_text(models, policy={"max_loaded": 1}), tmp_path) as h:
            await h.daemon.load("m")
            h.daemon.lifecycle.step_kv("m", 1, "test: down")
            model = h.daemon.herd.models["m"]
            assert model.state() is ModelState.STEPPING_KV
            await h.until(lambda: model.operation is None
                          and h.inst("m").state is State.READY, what="stepped down")
            assert h.inst("m").started_with.cache_type_k == "bf16"
            lease = await h.daemon.acquire("m")
            h.daemon.lifecycle.step_kv("m", 0, "test: up")
            assert model.state() is ModelState.STEPPING_KV
            unload = asyncio.ensure_future(h.daemon.unload("m", force=True))
            lease.release()
            await unload
            await _stays_stopped(h, "m")

    run(scenario())


def test_a_pinned_model_whose_restart_was_refused_comes_back_once_there_is_room(
        tiny_models, tmp_path):
    """e3e28ca: a pinned model's restart refused (no room) left it `stopped` for good: the
    code that keeps pinned models up restarted `failed` ones only."""
    models = _models(tiny_models, a={}, b={}, c={})

    def top(max_loaded: int) -> dict[str, Any]:
        return {"policy": {"max_loaded": max_loaded, "evict_timeout": 0.3,
                           "strategy": "pinned-group", "groups": ["core"]},
                "groups": {"core": {"models": ["a"]}}}

    async def scenario() -> None:
        async with running(config_text(models, **top(3)), tmp_path) as h:
            await h.until(lambda: h.inst("a").state is State.READY, what="pinned a up")
            lease_b = await h.daemon.acquire("b")
            lease_c = await h.daemon.acquire("c")
            # a restarts in place with its new ctx, and finds max_loaded full of busy models.
            models["a"]["ctx"] = 1024
            await h.reload(config_text(models, **top(2)))
            model = h.daemon.herd.models["a"]
            await h.until(lambda: model.waiting is not None, what="a waits, and says why")
            assert h.inst("a").state is not State.READY
            assert "max_loaded" in (model.waiting or ""), model.waiting
            assert h.daemon.describe_one("a")["waiting"] == model.waiting
            lease_b.release()  # idle now: evictable, and a is pinned
            await h.until(lambda: h.inst("a").state is State.READY, timeout=15,
                          what="pinned a back")
            assert h.inst("a").started_with.ctx == 1024 and model.waiting is None
            lease_c.release()

    run(scenario())


def test_an_admin_load_of_a_two_replica_model_starts_both(tiny_models, tmp_path):
    """e3e28ca: with max_loaded full, the load evicted another model "to start rep#2", then
    left rep#2 stopped."""
    models = _models(tiny_models, x={}, rep={"replicas": 2})

    async def scenario() -> None:
        async with running(config_text(models, policy={"max_loaded": 2}), tmp_path) as h:
            await h.daemon.load("x")
            await h.daemon.load("rep")
            assert h.inst("rep").state is State.READY, h.states()
            assert h.inst("rep#2").state is State.READY, h.states()
            assert h.inst("x").state is State.STOPPED  # made room, and it was used

    run(scenario())


def test_a_stale_process_group_is_never_signalled(tiny_models, tmp_path, monkeypatch):
    """e3e28ca: unloading a model whose child died long ago SIGKILLed the dead child's old
    process group; with the pid reused by another user's group leader, killpg raised EPERM,
    the stop task died before STOPPED and the model stayed `stopping` for good."""
    models = _models(tiny_models, m={})

    async def scenario() -> None:
        async with running(config_text(models), tmp_path) as h:
            await h.daemon.load("m")
            inst = h.inst("m")
            pid = inst.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await h.until(lambda: inst.state is State.FAILED, what="failed")
            await asyncio.sleep(0.2)  # the exit watcher has swept the group once
            signalled: list[int] = []

            def someone_elses(pgid: int, sig: int) -> None:
                signalled.append(pgid)
                raise PermissionError(1, "Operation not permitted")

            monkeypatch.setattr(os, "killpg", someone_elses)
            await asyncio.wait_for(h.daemon.unload("m"), 10)
            assert inst.state is State.STOPPED
            assert signalled == [], signalled
            monkeypatch.undo()

    run(scenario())


def test_a_start_failure_of_killpg_still_ends_the_stop_stopped(tiny_models, tmp_path,
                                                               monkeypatch):
    """Any error signalling a group ends the stop in `stopped`, the error logged."""
    models = _models(tiny_models, m={})

    async def scenario() -> None:
        async with running(config_text(models), tmp_path) as h:
            await h.daemon.load("m")
            inst = h.inst("m")
            real = os.killpg

            def refuse_sigterm(pgid: int, sig: int) -> None:
                if sig == signal.SIGTERM:
                    raise PermissionError(1, "Operation not permitted")
                real(pgid, sig)

            monkeypatch.setattr(os, "killpg", refuse_sigterm)
            await asyncio.wait_for(h.daemon.unload("m", force=True), 15)
            assert inst.state is State.STOPPED
            monkeypatch.undo()

    run(scenario())


def test_a_cold_request_waits_no_longer_than_queue_timeout(tiny_models, tmp_path):
    """e3e28ca: _wait_started had no deadline: a cold request to a slow-loading model waited
    up to start_timeout (900 s for vLLM), though queue_timeout bounds every wait."""
    models = _models(tiny_models, m={"queue_timeout": 1,
                                     "env": {"FAKE_UPSTREAM_DELAY": "4"}})

    async def scenario() -> None:
        async with running(config_text(models), tmp_path) as h:
            began = time.monotonic()
            with pytest.raises(QueueTimeout) as refused:
                await h.daemon.acquire("m")
            assert time.monotonic() - began < 2.5
            assert refused.value.retry_after  # 503 with Retry-After
            inst = h.inst("m")
            assert inst.state is State.STARTING  # the start goes on
            await h.until(lambda: inst.state is State.READY, what="ready after all")

    run(scenario())


def test_the_dead_mark_belongs_to_the_child_that_died(tiny_models, tmp_path, monkeypatch):
    """e3e28ca: a request that saw its child die marked the instance dead, and the mark
    outlived the restart: the next child's first stop skipped its prompt-cache save."""
    from corral.supervisor.prompt_cache.slots import Slots

    saved: list[str] = []

    async def save_all(self: Slots, until: float | None = None) -> None:
        saved.append("saved")

    monkeypatch.setattr(Slots, "save_all", save_all)
    models = _models(tiny_models, m={})

    async def scenario() -> None:
        async with running(config_text(models), tmp_path) as h:
            lease = await h.daemon.acquire("m")
            inst = h.inst("m")
            old = inst.pid
            assert old is not None
            os.kill(old, signal.SIGKILL)
            # Dead, and not yet seen by the exit watcher (the loop is held here): the request
            # is the first to find out.
            while inst.child_alive():
                time.sleep(0.001)
            await lease.report_broken()
            lease.release()
            assert inst.state is State.FAILED
            await h.daemon.load("m")
            assert inst.pid != old and inst.prompt_slots is not None
            await h.daemon.unload("m")
            assert saved == ["saved"], "the new child's stop skipped its prompt-cache save"

    run(scenario())


def test_a_request_that_queued_before_an_unload_does_not_start_the_model_again(
        tiny_models, tmp_path):
    """Found by the lifecycle property test: a cold request waiting for its start, an admin
    unload; the unload stopped the start, and the request, going round its wait, started the
    model again (the unload answered with the model `starting`)."""
    models = _models(tiny_models, m={"env": {"FAKE_UPSTREAM_DELAY": "0.5"}})

    async def scenario() -> None:
        async with running(config_text(models), tmp_path) as h:
            cold = asyncio.ensure_future(h.daemon.acquire("m"))
            await h.until(lambda: h.inst("m").state is State.STARTING, what="starting")
            status = await h.daemon.unload("m")
            assert status.state is State.STOPPED
            with pytest.raises(Unloaded):
                await cold
            await _stays_stopped(h, "m")

    run(scenario())


def test_a_switch_over_never_promotes_a_child_that_died_once_ready(tiny_models, tmp_path,
                                                                   monkeypatch):
    """e3e28ca: a switch-over promoted the new child without checking it was still ready:
    one that died between its readiness and the switch took the model's name, and the old,
    working child was drained away."""
    from corral.supervisor.instance import Instance

    models = _models(tiny_models, m={})
    real_wait_ready = Instance.wait_ready

    async def scenario() -> None:
        async with running(config_text(models), tmp_path) as h:
            await h.daemon.load("m")
            old = h.inst("m")
            old_pid = old.pid

            async def ready_then_dead(self: Instance) -> None:
                await real_wait_ready(self)
                if self is h.daemon.herd.models["m"].incoming and self.pid is not None:
                    os.kill(self.pid, signal.SIGKILL)
                    await h.until(lambda: self.state is State.FAILED, what="the new one died")

            monkeypatch.setattr(Instance, "wait_ready", ready_then_dead)
            models["m"]["ctx"] = 1024
            await h.reload(config_text(models))
            await h.until(lambda: h.daemon.herd.models["m"].incoming is None, what="ended")
            monkeypatch.undo()
            assert h.inst("m") is old and old.state is State.READY and old.pid == old_pid, \
                h.states()
            assert "failed to start" in (old.last_error or ""), old.last_error

    run(scenario())
