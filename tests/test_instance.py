"""An instance driven directly, in-process, over a real llama-server child."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from corral.supervisor.backends.llama_server import LlamaServer
from corral.supervisor.config import parse_config
from corral.supervisor.instance import Instance, State
from corral.supervisor.instance import launch as instance_module


def test_start_retries_once_when_its_port_was_taken(tiny_models, monkeypatch):
    """Someone binds the port corral picked before the child does: corral retries elsewhere.
    The port picker is the only stand-in here; it hands out a port that is already taken."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    picked: list[int] = []
    real_free_port = instance_module.free_port

    def pick() -> int:
        picked.append(taken if not picked else real_free_port())
        return picked[-1]

    monkeypatch.setattr(instance_module, "free_port", pick)
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
