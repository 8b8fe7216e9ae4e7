"""An instance driven directly, in-process, over a real llama-server child."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path

import aiohttp
import pytest

from corral.supervisor.backends.llama_server import LlamaServer
from corral.supervisor.config import parse_config
from corral.supervisor.instance import Instance, State
from corral.supervisor.instance import launch as instance_module
from corral.supervisor.listener import process_listens

from conftest import llama_server_binary, wait_until


def _first_pick_is(taken: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The port picker hands out `taken` first, then free ports: the ports it handed out."""
    picked: list[int] = []
    real_free_port = instance_module.free_port

    def pick() -> int:
        picked.append(taken if not picked else real_free_port())
        return picked[-1]

    monkeypatch.setattr(instance_module, "free_port", pick)
    return picked


def test_start_retries_once_when_its_port_was_taken(tiny_models, monkeypatch):
    """Someone binds the port corral picked before the child does: corral retries elsewhere.
    The port picker is the only stand-in here; it hands out a port that is already taken."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    picked = _first_pick_is(taken, monkeypatch)
    spec = parse_config(f"models: {{a: {{model: '{tiny_models['tiny-a']}'}}}}").models["a"]

    async def run() -> None:
        inst = Instance(spec, LlamaServer(), on_change=lambda: None)
        async with aiohttp.ClientSession() as session:
            inst.begin_start(session, on_spawn=lambda _: None)
            await inst.wait_ready()
            try:
                assert inst.state is State.READY
                assert picked[0] == taken and inst.port == picked[1] != taken
                assert inst.starts == 1 and inst.last_error is None
            finally:
                await inst.stop("test over")

    try:
        asyncio.run(run())
    finally:
        squatter.close()


def _stranger(model: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A llama-server of someone else's (its own key) listening on a port of its own. The
    port is picked, then bound by the server: another test worker may take it in between,
    and then the server exits on its bind and another port is tried."""
    for _ in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen(
            [llama_server_binary(), "--model", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--api-key", "someone-elses"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_until(lambda server=server, port=port: server.poll() is not None
                   or process_listens(server.pid, port), timeout=60)
        if server.poll() is None:
            return server, port
    raise AssertionError("no port held by the stranger in five tries")


def test_a_stranger_that_answers_on_the_picked_port_is_not_taken_for_the_child(
        tiny_models, monkeypatch):
    """Another daemon's llama-server (its own key) took the port corral picked before the
    child bound it. Its /health answers 200 like the child's would: corral must not go READY
    in front of it (every request would get its 401), but retry on another port. The port
    picker is the only stand-in; the stranger is a real llama-server."""
    stranger, taken = _stranger(tiny_models["tiny-b"])
    picked = _first_pick_is(taken, monkeypatch)
    spec = parse_config(f"models: {{a: {{model: '{tiny_models['tiny-a']}'}}}}").models["a"]

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            async def stranger_ready() -> None:
                while True:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.get(f"http://127.0.0.1:{taken}/health") as r:
                            if r.status == 200:
                                return
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(stranger_ready(), 60)
            inst = Instance(spec, LlamaServer(), on_change=lambda: None)
            inst.begin_start(session, on_spawn=lambda _: None)
            await inst.wait_ready()
            try:
                assert inst.state is State.READY
                assert picked[0] == taken and inst.port == picked[1] != taken
                async with session.post(f"http://127.0.0.1:{inst.port}/v1/completions",
                                        headers=inst._headers,
                                        json={"prompt": "hi", "max_tokens": 1}) as resp:
                    assert resp.status == 200, await resp.text()
            finally:
                await inst.stop("test over")

    try:
        asyncio.run(run())
    finally:
        os.killpg(stranger.pid, signal.SIGKILL)
        stranger.wait()


def test_start_gives_up_after_the_second_lost_race(tiny_models, monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    monkeypatch.setattr(instance_module, "free_port", lambda: squatter.getsockname()[1])
    spec = parse_config(f"models: {{a: {{model: '{tiny_models['tiny-a']}'}}}}").models["a"]

    async def run() -> None:
        inst = Instance(spec, LlamaServer(), on_change=lambda: None)
        async with aiohttp.ClientSession() as session:
            inst.begin_start(session, on_spawn=lambda _: None)
            with pytest.raises(instance_module.StartFailed, match="exited") as failure:
                await inst.wait_ready()
            # The child's words travel beside the message (admin logs, daemon log), not in it.
            assert any("couldn't bind" in line for line in failure.value.tail)
            assert inst.state is State.FAILED

    try:
        asyncio.run(run())
    finally:
        squatter.close()
