"""The instance's closed state machine, driven in-process over real llama-server children:
every race the issue names (stop during start, a start under a pending stop, a non-StartFailed
error in a start, timeout then kill ordering, a stop that SIGKILL cannot finish)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from corral.supervisor.backends.llama_server import LlamaServer
from corral.supervisor.config import ModelSpec, parse_config
from corral.supervisor.errors import StartFailed
from corral.supervisor.instance import IllegalTransition, Instance, State
from corral.supervisor.process import ChildProcess


def _spec(tiny_models: dict[str, Any], **settings: Any) -> ModelSpec:
    extra = "".join(f", {k}: {v}" for k, v in settings.items())
    return parse_config(
        f"models: {{a: {{model: '{tiny_models['tiny-a']}', ctx: 512{extra}}}}}").models["a"]


def _run(scenario: Callable[[aiohttp.ClientSession], Awaitable[None]]) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            await scenario(session)
    asyncio.run(main())


class _Recorder:
    """on_change: what the instance looked like at every change (state, child alive)."""

    def __init__(self) -> None:
        self.seen: list[tuple[State, bool]] = []
        self.inst: Instance | None = None

    def __call__(self) -> None:
        if self.inst is not None:
            self.seen.append((self.inst.state, self.inst.child_alive()))


def test_a_start_is_refused_while_a_stop_is_pending(tiny_models):
    async def scenario(session: aiohttp.ClientSession) -> None:
        recorder = _Recorder()
        inst = Instance(_spec(tiny_models), LlamaServer(), on_change=recorder)
        recorder.inst = inst
        inst.begin_start(session, on_spawn=lambda _: None)
        await inst.wait_ready()
        lease = await inst.take_slot(5)  # a request in flight: the drain waits for it
        stop = inst.begin_stop("test", drain=30)
        assert stop is not None and inst.state is State.DRAINING
        with pytest.raises(IllegalTransition):
            inst.begin_start(session, on_spawn=lambda _: None)
        # The child dies mid-drain: the stop still owns the ending (no FAILED, no restart).
        assert inst.process is not None
        await inst.process.stop(0)
        inst.mark_if_dead()
        if not stop.done():
            assert not inst.can_start
            with pytest.raises(IllegalTransition):
                inst.begin_start(session, on_spawn=lambda _: None)
        lease.release()
        await asyncio.wait_for(stop, 10)
        assert inst.state is State.STOPPED and inst.can_start
        assert State.FAILED not in [state for state, _ in recorder.seen], recorder.seen

    _run(scenario)


def test_a_stop_during_a_start_ends_stopped_with_no_child(tiny_models):
    async def scenario(session: aiohttp.ClientSession) -> None:
        inst = Instance(_spec(tiny_models), LlamaServer(), on_change=lambda: None)
        for delay in (0, 0.01, 0.05):  # before the spawn, during it, while it loads
            inst.begin_start(session, on_spawn=lambda _: None)
            await asyncio.sleep(delay)
            process = inst.process
            await asyncio.wait_for(inst.stop("test"), 10)
            assert inst.state is State.STOPPED
            assert process is None or not process.alive()
            # Its waiters are told (cancelled), or it had finished just before the stop.
            with contextlib.suppress(asyncio.CancelledError):
                await inst.wait_ready()
            assert inst.state is State.STOPPED and inst.can_start

    _run(scenario)


class _Crashing(LlamaServer):
    """A backend whose argv building hits a bug (not a StartFailed)."""

    def argv(self, spec: ModelSpec, port: int) -> list[str]:
        raise ValueError("a GGUF that will not parse")


def test_any_error_in_a_start_ends_failed_with_the_reason_and_a_backoff(tiny_models):
    async def scenario(session: aiohttp.ClientSession) -> None:
        inst = Instance(_spec(tiny_models, start_backoff=5), _Crashing(), on_change=lambda: None)
        inst.begin_start(session, on_spawn=lambda _: None)
        with pytest.raises(StartFailed) as failed:
            await asyncio.wait_for(inst.wait_ready(), 10)
        # The exception's text is the operator's (last_error, the log); a client is told
        # what failed without it.
        assert "will not parse" in (failed.value.for_operators or "")
        assert "will not parse" not in str(failed.value) and "ValueError" in str(failed.value)
        assert inst.state is State.FAILED
        assert "ValueError" in (inst.last_error or "") and "will not parse" in inst.last_error
        assert inst.start_failures == 1 and inst.backoff_left() > 0
        assert inst.can_start  # not wedged: an operator's load may try again now

    _run(scenario)


class _NeverHealthy(LlamaServer):
    health_path = "/no-such-health-path"  # 404 forever: the start times out


def test_a_start_timeout_kills_the_child_before_it_marks_the_model_failed(tiny_models):
    async def scenario(session: aiohttp.ClientSession) -> None:
        recorder = _Recorder()
        inst = Instance(_spec(tiny_models, start_timeout=1.5, start_backoff=0), _NeverHealthy(),
                        on_change=recorder)
        recorder.inst = inst
        inst.begin_start(session, on_spawn=lambda _: None)
        with pytest.raises(StartFailed, match="not ready"):
            await asyncio.wait_for(inst.wait_ready(), 20)
        failed = [alive for state, alive in recorder.seen if state is State.FAILED]
        assert failed == [False], recorder.seen  # killed first, failed after

    _run(scenario)


def test_a_stop_gives_up_on_a_child_that_sigkill_cannot_end(monkeypatch):
    """A child in uninterruptible sleep ignores SIGKILL; this machine cannot make one, so the
    wait for its exit is what stands in (it never returns), and the real process is reaped
    by the test afterwards."""
    async def scenario() -> None:
        child = ChildProcess("stuck", [sys.executable, "-c", "import time; time.sleep(60)"], {})
        await child.spawn()
        child.kill_wait = 0.3
        never: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def hangs() -> int:
            return await never

        monkeypatch.setattr(child, "wait", hangs)
        code = await asyncio.wait_for(child.stop(0.1), 5)
        assert code is None and child.pid is not None
        subprocess.run(["kill", "-9", str(child.pid)], check=False)
        never.cancel()

    asyncio.run(scenario())
