"""A stateful property test of the model lifecycle: hypothesis drives one daemon, over fake
children that start and stop in milliseconds (tests/fake_upstream.py), through interleavings
of requests (waited for, and left running in the background), admin and user loads and
unloads (drained and forced), reloads that restart in place or switch over, KV steps down
and up, pressure on room (max_loaded lowered, the memory loop asked to relieve), crashes
(SIGKILL), hangs (SIGSTOP), pinning and unpinning, replicas up and down. After every step
it checks the invariants against a simple model of what was asked:

- no state outside the tables (an instance's, a model's);
- an unload that answered leaves its model stopped until a request or a load names it (or a
  reload pins it anew): nothing of a restart, switch-over or KV step brings it back;
- no child leaks: every fake child running belongs to an instance the daemon shows;
- no request waits past its queue_timeout (plus the start it may share) without an answer;
- at the end of each example, with nothing in flight: the pinned model is ready again within
  its back-off (unless unloaded), and the daemon's tasks and children are all accounted for.

The daemon is shared by the examples (one start, one close): each example begins from a reset
(the base config, every model unloaded and the unloads forgotten)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from lifecycle_harness import Harness, config_text, running

from corral.supervisor.errors import InUse, NotAllowed, SupervisorError
from corral.supervisor.instance import State
from corral.supervisor.model import ModelState
from corral.supervisor.model import core as model_core

QUEUE_TIMEOUT = 2.0
MODELS = ("a", "p", "r")  # a: adaptive KV; p: pinned; r: replicas
# About 0.55 s an example of up to 12 steps on a 2-core machine (real children, real waits).
EXAMPLES = int(os.environ.get("CORRAL_LIFECYCLE_EXAMPLES", "100"))


class Shape:
    """The config the machine asks for, as data."""

    def __init__(self) -> None:
        self.ctx = {m: 512 for m in MODELS}
        self.pin_a = False
        self.replicas_max = 2
        self.max_loaded = 4

    def text(self, tiny: dict[str, Path]) -> str:
        models = {
            "a": {"model": str(tiny["tiny-a"]), "ctx": self.ctx["a"],
                  "kv_cache": {"adaptive": True, "ladder": ["f16", "bf16"]}},
            "p": {"model": str(tiny["tiny-b"]), "ctx": self.ctx["p"]},
            "r": {"model": str(tiny["tiny-c"]), "ctx": self.ctx["r"],
                  "replicas": {"min": 1, "max": self.replicas_max, "scale_after": 0.1}},
        }
        for settings_ in models.values():
            settings_.update(FAST, queue_timeout=QUEUE_TIMEOUT)
        core = ["p", "a"] if self.pin_a else ["p"]
        return config_text(models, groups={"core": {"models": core}},
                           policy={"strategy": "pinned-group", "groups": ["core"],
                                   "max_loaded": self.max_loaded, "evict_timeout": 0.3})


# Fake children start and stop in milliseconds: the lifecycle's clocks are set to match.
FAST = {"stop_grace": 0.2, "health_interval": 0.1, "health_timeout": 0.2,
        "start_backoff": 0.05, "start_backoff_max": 0.2}


def test_the_model_lifecycle_holds_its_invariants(tiny_models, tmp_path, monkeypatch):
    # A pinned model's keeper retries a refused start after 1 s, doubling: 50 ms here.
    monkeypatch.setattr(model_core, "KEEP_UP_FIRST_S", 0.05)
    monkeypatch.setattr(model_core, "KEEP_UP_MAX_S", 0.4)
    loop = asyncio.new_event_loop()
    began = time.monotonic()
    found: dict[str, Any] = {"examples": 0, "steps": 0, "unloads_held": 0,
                             "switch_overs": 0, "restarts": 0, "kv_steps": 0}

    async def open_harness() -> tuple[Harness, contextlib.AbstractAsyncContextManager[Any]]:
        context = running(Shape().text(tiny_models), tmp_path)
        harness = await context.__aenter__()
        return harness, context

    harness, context = loop.run_until_complete(open_harness())

    class Lifecycle(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.h = harness
            self.shape = Shape()
            self.down: dict[str, bool] = {m: False for m in MODELS}
            self.background: list[asyncio.Task[None]] = []
            found["examples"] += 1
            self.run(self._reset())

        # -- plumbing --------------------------------------------------------------------------

        def run(self, coro: Any, timeout: float = 30.0) -> Any:
            return loop.run_until_complete(asyncio.wait_for(coro, timeout))

        async def _reset(self) -> None:
            h = self.h
            await h.reload(self.shape.text(tiny_models))
            for pid in list(h.stopped_pids):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            h.stopped_pids.clear()
            await asyncio.gather(*(h.daemon.unload(m, force=True) for m in MODELS),
                                 return_exceptions=True)
            await h.until(lambda: all(i.state is State.STOPPED
                                      for i in h.daemon.herd.everyone()), 15, "reset")
            for model in h.daemon.herd.models.values():
                model.pin_anew()  # the unloads of the reset are not the example's
            # The pinned model comes back (its pin); the example starts from there.
            await h.until(lambda: h.inst("p").state is State.READY, 15, "p up after reset")

        async def _settle(self, seconds: float = 0.05) -> None:
            await asyncio.sleep(seconds)

        def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
            """A synchronous transition, made on the loop (it starts tasks)."""
            async def on_the_loop() -> Any:
                return fn(*args, **kwargs)
            return self.run(on_the_loop())

        def _pids(self, model: str) -> list[int]:
            found_ = self.h.daemon.herd.models[model]
            return [i.pid for i in found_.everyone()
                    if i.pid is not None and i.state in (State.READY, State.STARTING)]

        # -- rules -----------------------------------------------------------------------------

        @rule(model=st.sampled_from(MODELS))
        def request(self, model: str) -> None:
            self.down[model] = False
            self.run(self._request(model, 0.0))

        @rule(model=st.sampled_from(MODELS), hold=st.floats(0, 0.3))
        def request_in_background(self, model: str, hold: float) -> None:
            self.down[model] = False
            self.background.append(loop.create_task(self._request(model, hold)))
            self.run(self._settle(0.02))

        async def _request(self, model: str, hold: float) -> None:
            began = time.monotonic()
            try:
                lease = await self.h.daemon.acquire(model)
            except SupervisorError:
                pass  # told why (unloaded, back-off, no room, queue timeout): an answer
            else:
                await asyncio.sleep(hold)
                lease.release()
            waited = time.monotonic() - began
            # The door's bound, and a start it shared may finish within the last wait.
            assert waited <= QUEUE_TIMEOUT + 1.5, f"{model}: a request waited {waited:.1f}s"

        @rule(model=st.sampled_from(MODELS))
        def load(self, model: str) -> None:
            self.down[model] = False
            with contextlib.suppress(SupervisorError):
                self.run(self.h.daemon.load(model))

        @rule(model=st.sampled_from(MODELS), force=st.booleans())
        def unload_as_admin(self, model: str, force: bool) -> None:
            status = self.run(self.h.daemon.unload(model, force=force))
            assert status.state is State.STOPPED, self.h.states()
            self.down[model] = True
            found["unloads_held"] += 1

        @rule(model=st.sampled_from(MODELS))
        def unload_as_user(self, model: str) -> None:
            try:
                self.call(self.h.daemon.unload_soon, model, admin=False)
            except (NotAllowed, InUse):
                return  # pinned, or busy: the operator's to stop
            self.down[model] = True

        @rule(model=st.sampled_from(MODELS), room=st.booleans())
        def reload_that_restarts(self, model: str, room: bool) -> None:
            """With room, a serving model switches over (blue/green); without (max_loaded
            down to what runs), it restarts in place."""
            self.shape.ctx[model] = 1024 if self.shape.ctx[model] == 512 else 512
            if not room:
                self.shape.max_loaded = max(2, len(self.h.daemon.herd.live()))
            herd = self.h.daemon.herd
            self.run(self.h.reload(self.shape.text(tiny_models)))
            state = herd.models[model].state()
            found["switch_overs"] += state is ModelState.SWITCHING
            found["restarts"] += state is ModelState.RESTARTING

        @rule(level=st.integers(0, 1))
        def kv_step(self, level: int) -> None:
            self.call(self.h.daemon.lifecycle.step_kv, "a", level, "the property test")
            found["kv_steps"] += self.h.daemon.herd.models["a"].stepping_kv

        @rule()
        def room_pressure(self) -> None:
            self.shape.max_loaded = 2 if self.shape.max_loaded == 4 else 4
            self.run(self.h.reload(self.shape.text(tiny_models)))
            self.call(self.h.daemon.memory_loop.relieve)

        @rule(model=st.sampled_from(MODELS))
        def crash(self, model: str) -> None:
            for pid in self._pids(model)[:1]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.run(self._settle(0.05))

        @rule(model=st.sampled_from(MODELS))
        def hang(self, model: str) -> None:
            for pid in self._pids(model)[:1]:
                with contextlib.suppress(ProcessLookupError):
                    self.h.freeze(pid)
            self.run(self._settle(0.05))

        @rule()
        def pin_or_unpin(self) -> None:
            self.shape.pin_a = not self.shape.pin_a
            self.run(self.h.reload(self.shape.text(tiny_models)))
            if self.shape.pin_a:
                self.down["a"] = False  # a reload that pins it brings it up

        @rule()
        def replicas_up_or_down(self) -> None:
            self.shape.replicas_max = 1 if self.shape.replicas_max == 2 else 2
            self.run(self.h.reload(self.shape.text(tiny_models)))

        # -- invariants ------------------------------------------------------------------------

        @invariant()
        def states_are_in_the_tables(self) -> None:
            found["steps"] += 1
            for inst in self.h.daemon.herd.everyone():
                assert isinstance(inst.state, State)
            for model in self.h.daemon.herd.models.values():
                assert isinstance(model.state(), ModelState)

        @invariant()
        def an_answered_unload_holds(self) -> None:
            for name, down in self.down.items():
                if not down:
                    continue
                model = self.h.daemon.herd.models[name]
                up = [(i.name, str(i.state)) for i in model.everyone()
                      if i.state in (State.STARTING, State.READY)]
                assert not up, f"{name} was unloaded, yet {up}: {self.h.states()}"
                assert model.operation is None, (name, model.operation)

        @invariant()
        def no_child_leaks(self) -> None:
            # A child being spawned has no pid on its instance for a moment: look twice.
            leaked = self.h.children() - self.h.owned()
            for _ in range(20):
                if not leaked:
                    break
                self.run(self._settle(0.01))
                leaked = self.h.children() - self.h.owned()
            assert not leaked, f"children nobody owns: {leaked}; {self.h.states()}"

        def teardown(self) -> None:
            async def finish() -> None:
                for task in self.background:
                    await task  # each ends within its queue_timeout (asserted inside)
                for pid in list(self.h.stopped_pids):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                self.h.stopped_pids.clear()
                if not self.down["p"]:
                    # With nothing in flight, the pinned model is ready again within its
                    # back-off once room allows.
                    await self.h.until(lambda: self.h.inst("p").state is State.READY, 20,
                                       "the pinned model back")
            self.run(finish(), 60)

    try:
        run_state_machine_as_test(Lifecycle, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=12, deadline=None, derandomize=True,
            suppress_health_check=list(HealthCheck), print_blob=True))
    finally:
        loop.run_until_complete(context.__aexit__(None, None, None))
        loop.close()
    print(f"lifecycle property test: {found} in {time.monotonic() - began:.0f}s")
    assert found["examples"] >= min(EXAMPLES, 100)
    assert found["switch_overs"] and found["restarts"] and found["kv_steps"], found
