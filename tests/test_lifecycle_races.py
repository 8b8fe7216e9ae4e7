"""A model's lifecycle under races, on real daemons over tests/fake_upstream.py children (a
`llama-server` stand-in that starts in milliseconds, or after FAKE_UPSTREAM_DELAY seconds):
what the client is told, what /admin/models ends in, what is left behind."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from lifecycle_harness import FAKE, config_text, running

from corral.supervisor.errors import SettingsDiffer, UnknownModel, Unloaded
from corral.supervisor.instance import State

from conftest import CorralFactory, wait_until


def _config(tiny_models: dict[str, Path], **settings: Any) -> dict[str, Any]:
    return {"binary": str(FAKE), "defaults": {"ttl": 300, "stop_grace": 1},
            "models": {"m": {"model": str(tiny_models["tiny-a"]), **settings}}}


def _in_thread(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["response"] = call()
        except httpx.HTTPError as exc:  # the failure the test looks for: no answer at all
            out["error"] = repr(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_load_waiting_for_its_start_at_shutdown_is_told_so(start_corral: CorralFactory,
                                                              tiny_models: dict[str, Path]):
    """Before: SIGTERM while `POST /admin/models/m/load` waited for a slow start cancelled the
    daemon's load task, and its cancellation became the handler's: the client got no answer
    ('Server disconnected without sending a response'; `corral load` a connection error),
    while a chat request waiting on the same start got a 503 shutting_down."""
    corral = start_corral(_config(tiny_models, env={"FAKE_UPSTREAM_DELAY": "5"}))
    corral.expect("proxy.request_failed")  # the chat's 503, logged as every 5xx is
    load, loaded = _in_thread(lambda: httpx.post(corral.url + "/admin/models/m/load",
                                                 timeout=30))
    chat, chatted = _in_thread(lambda: corral.chat("m", timeout=30))
    wait_until(lambda: corral.model("m")["state"] == "starting"
               and corral.model("m")["queue"] == 2)
    corral.proc.send_signal(signal.SIGTERM)
    load.join(30)
    chat.join(30)
    for out in (loaded, chatted):
        assert "response" in out, out
        response = out["response"]
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "shutting_down"
    assert corral.proc.wait(30) == 0


def test_a_reload_cut_short_by_shutdown_is_told_so(start_corral: CorralFactory,
                                                   tiny_models: dict[str, Path],
                                                   tmp_path: Path):
    """Before: SIGTERM while `POST /admin/reload` read the new config (here a strategy plugin
    slow to import) cancelled the reload task, and the handler, waiting on it, passed the
    cancellation on: the client got no answer at all. Now a 503 shutting_down; the reload is
    not applied (and the log says so)."""
    first = tmp_path / "corral.yaml"
    first.write_text(yaml.safe_dump(_config(tiny_models)))
    # No file watcher: the reload is the request's own.
    corral = start_corral.spawn(["-c", str(first), "--no-watch"], first)
    # "cancelled: corral is shutting down; not applied"; the 503, logged as every 5xx is
    corral.expect("daemon.reload_failed", "proxy.request_failed")
    began = tmp_path / "import-began"
    (tmp_path / "slow.py").write_text(
        "import pathlib, time\n"
        "from corral.supervisor.policy import Generic\n"
        f"pathlib.Path({str(began)!r}).touch()\n"
        "time.sleep(2)\n"
        "class Slow(Generic):\n"
        "    pass\n")
    config = _config(tiny_models)
    config["policy"] = {"strategy": f"plugin:{tmp_path / 'slow.py'}:Slow"}
    first.write_text(yaml.safe_dump(config))
    reload, reloaded = _in_thread(lambda: httpx.post(corral.url + "/admin/reload", timeout=30))
    wait_until(began.exists)
    corral.proc.send_signal(signal.SIGTERM)
    reload.join(30)
    assert "response" in reloaded, reloaded
    assert reloaded["response"].status_code == 503, reloaded["response"].text
    assert reloaded["response"].json()["error"]["code"] == "shutting_down"
    assert corral.proc.wait(30) == 0


def test_a_reload_that_changes_the_model_during_a_load_with_overrides_wins(
        tiny_models: dict[str, Path], tmp_path: Path):
    """Before: a reload that changed `m` (ctx 512 -> 1024) while `load m {"ctx": 256}` waited
    for its start restarted it with the load's claim still in force: the child ran ctx 256,
    masking the reload's change (docs/api.md: such a reload ends the overrides), and the load
    answered 200. Now the restart runs the new config and the load is a 409 settings_differ
    naming what runs."""
    models = {"m": {"model": str(tiny_models["tiny-a"]), "env": {"FAKE_UPSTREAM_DELAY": "0.5"}}}

    async def scenario() -> None:
        async with running(config_text(models), tmp_path) as h:
            load = asyncio.ensure_future(h.daemon.load("m", {"ctx": 256}))
            await h.until(lambda: h.inst("m").state is State.STARTING, what="starting")
            models["m"]["ctx"] = 1024
            await h.reload(config_text(models))
            with pytest.raises(SettingsDiffer, match="ctx 1024"):
                await load
            await h.until(lambda: h.inst("m").state is State.READY, what="ready")
            inst = h.inst("m")
            assert inst.started_with.ctx == 1024, h.states()
            assert not inst.started_with.overrides
            assert not h.daemon.herd.models["m"].overrides

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_an_unload_during_a_rebalance_leaves_the_model_stopped(tiny_models: dict[str, Path],
                                                               tmp_path: Path):
    """Before: an unload while a rebalance (RPC workers back: drain, stop, start again) drained
    the model joined the rebalance's stop and answered `stopped`; then the rebalance started
    the model again. An unload wins: the rebalance is called off (Unloaded)."""
    models = {"m": {"model": str(tiny_models["tiny-a"]), "stop_grace": 2}}

    async def scenario() -> None:
        async with running(config_text(models), tmp_path) as h:
            await h.daemon.load("m")
            lease = await h.daemon.acquire("m")  # in flight: the rebalance drains it first
            model = h.daemon.herd.models["m"]
            # What POST /admin/models/m/rebalance runs for a model split over RPC workers.
            rebalance = asyncio.ensure_future(h.daemon.admin._rebalance(model))
            await h.until(lambda: h.inst("m").state is State.DRAINING, what="draining")
            unload = asyncio.ensure_future(h.daemon.unload("m"))
            lease.release()
            assert (await unload).state is State.STOPPED
            with pytest.raises(Unloaded):
                await rebalance
            assert h.inst("m").state is State.STOPPED, h.states()
            assert not h.children()

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def one_in_flight_one_queued(h: Any, name: str) -> tuple[Any, Any, asyncio.Future[Any]]:
    """`name` (parallel 1) with a request in flight (its lease) and one queued for its slot."""
    lease = await h.daemon.acquire(name)
    inst = h.inst(name)
    queued = asyncio.ensure_future(h.daemon.acquire(name))
    await h.until(lambda: inst.queued == 1, what="queued")
    return lease, inst, queued


def test_requests_queued_on_a_model_a_reload_removes_are_told_at_once(
        tiny_models: dict[str, Path], tmp_path: Path):
    """Before: a request queued for a slot of a model (one request in flight, parallel 1) that
    a reload removed waited for the in-flight one to end, up to the whole drain
    (`shutdown_grace`), before it was told the model is gone. Now it is told at once; the one
    in flight still finishes on its child."""
    models: dict[str, Any] = {
        "m": {"model": str(tiny_models["tiny-a"]), "parallel": 1},
        "n": {"model": str(tiny_models["tiny-b"])}}

    async def scenario() -> None:
        async with running(config_text(models, shutdown_grace=30), tmp_path) as h:
            lease, inst, queued = await one_in_flight_one_queued(h, "m")
            del models["m"]
            await h.reload(config_text(models, shutdown_grace=30))
            with pytest.raises(UnknownModel):
                await asyncio.wait_for(queued, 5)
            assert inst.state is State.DRAINING and inst.in_flight == 1, h.states()
            lease.release()
            await h.until(lambda: inst.state is State.STOPPED, what="stopped")
            assert not h.children()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_requests_queued_on_a_model_being_unloaded_are_told_at_once(
        tiny_models: dict[str, Path], tmp_path: Path):
    """Before: a request queued for a slot (one in flight, parallel 1) when an admin unload
    began waited for the drain to end (up to `shutdown_grace`), or past its queue_timeout got
    a 503 'no free slot', before it was told the model was unloaded. Now it is told at once;
    the one in flight finishes, and the model starts again with its usual slots."""
    models: dict[str, Any] = {"m": {"model": str(tiny_models["tiny-a"]), "parallel": 1}}

    async def scenario() -> None:
        async with running(config_text(models, shutdown_grace=30), tmp_path) as h:
            lease, inst, queued = await one_in_flight_one_queued(h, "m")
            unload = asyncio.ensure_future(h.daemon.unload("m"))
            with pytest.raises(Unloaded):
                await asyncio.wait_for(queued, 2)
            assert inst.state is State.DRAINING and inst.in_flight == 1, h.states()
            lease.release()
            assert (await unload).state is State.STOPPED
            # Started again: one slot, as before (the woken waiters left none behind).
            first = await h.daemon.acquire("m")
            second = asyncio.ensure_future(h.daemon.acquire("m"))
            await h.until(lambda: inst.queued == 1, what="queued behind the first")
            assert not second.done() and inst.in_flight == 1
            first.release()
            (await asyncio.wait_for(second, 2)).release()

    asyncio.run(asyncio.wait_for(scenario(), 60))
