"""Admin commands: load, unload (drained, or forced), rebalance a split model. An operator's
command goes through the same door and the same model state machine as a request; an unload
wins over whatever the model was doing."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from typing import Any

import structlog

from corral.supervisor.daemon.door import Door
from corral.supervisor.daemon.herd import Herd
from corral.supervisor.errors import (
    InUse,
    NotAllowed,
    NotServed,
    ShuttingDown,
    SupervisorError,
    Unloaded,
)
from corral.supervisor.instance import State
from corral.supervisor.model import Model, OperationRefused
from corral.supervisor.model.overrides import (
    Overrides,
    SettingsDiffer,
    check_overrides,
    running_differs,
)
from corral.supervisor.tasks import TaskScope

log = structlog.get_logger("corral.daemon")


class Admin:
    def __init__(self, herd: Herd, door: Door, tasks: TaskScope):
        self._herd = herd
        self._door = door
        self._tasks = tasks  # the daemon's: work a caller may walk away from

    async def load(self, name: str, overrides: Mapping[str, Any] | None = None,
                   restart: bool = False) -> str:
        """Up and ready, with every replica its spec starts with; the model's name. A caller
        that hangs up only stops waiting. An operator asking explicitly is the retry a
        back-off waits for. `overrides` (checked before anything starts: BadOverride) apply
        to the starts this load makes; a model already up with other settings is refused
        (SettingsDiffer) unless `restart`, which drains and restarts it with them."""
        model = self._herd.model(name)
        spec = model.spec
        # An unload from now on wins, even one that comes while the check below runs (it
        # reads the GGUF header and asks the binary): the load must not undo it.
        unloads = model.primary.unloads
        checked = await asyncio.to_thread(check_overrides, spec, overrides or {})
        _refuse_if_unloaded(model, unloads)
        if self._herd.closing:  # before the claim below: no task of this load would end it
            raise ShuttingDown("corral is shutting down")
        # From here to the claim below no await: two loads cannot both find the model free.
        up = [r for r in model.members if r.state in (State.STARTING, State.READY)]
        if up and not restart:
            differs = running_differs(checked.apply(spec), up[0].started_with) \
                if checked else []
            if differs:
                raise SettingsDiffer(
                    f"{model.name} runs with other settings ({', '.join(differs)}: "
                    + ", ".join(f"{f} {getattr(up[0].started_with, f)}" for f in differs)
                    + "); load it again with \"restart\": true to restart it with these")
        pending = model.overrides
        restarts = bool(up) and restart
        if pending and pending != checked and (checked or restarts):
            # Another load's overrides are under way (its child may not be STARTING yet):
            # the first one asked wins; this one would get a 200 over settings not its own
            # (a restart asking none asks the config's, and would drop that load's claim).
            raise SettingsDiffer(
                f"{model.name} is being loaded with other settings ({_said(pending)}); "
                f"load it again once that load is done, with \"restart\": true")
        if checked and not pending:
            # Claimed now: a start from here on runs them. A load asking the same joins the
            # claim without owning it: only the load that claimed it ends it.
            model.overrides = checked
        calls_off = model.called_off
        work = self._restart(model, checked, unloads, calls_off) if restarts else \
            self._load_with(model, checked, unloads, calls_off)
        await self._run(work, f"load:{model.name}")
        return model.name

    async def _run(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run `work` as the daemon's task and wait for it. The shutdown cancels the daemon's
        tasks: the caller, who is not cancelled, is told so (503 shutting_down) rather than
        handed the task's cancellation (its client got no answer at all). Checked with no
        await before the spawn: a scope closed by the shutdown takes no task (ScopeClosed,
        a 500)."""
        if self._herd.closing:
            work.close()
            raise ShuttingDown("corral is shutting down")
        try:
            await self._tasks.run(work, name)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if (task is not None and task.cancelling()) or not self._herd.closing:
                raise  # the caller itself went away (its client hung up)
            raise ShuttingDown(f"corral is shutting down: {name} was called off") from None

    async def _load_with(self, model: Model, overrides: Overrides, unloads: int,
                         calls_off: int) -> None:
        try:
            _refuse_if_unloaded(model, unloads)
            await self._load(model, ignore_backoff=True)
            _refuse_if_overtaken(model, overrides, calls_off)
        finally:
            if overrides and model.overrides is overrides:
                model.overrides = Overrides()

    async def _restart(self, model: Model, overrides: Overrides, unloads: int,
                       calls_off: int) -> None:
        """Drain and restart in place (requests wait for it, none fail), with `overrides`.
        An unload meanwhile cancels the restart and wins: the load says so (Unloaded)."""
        try:
            _refuse_if_unloaded(model, unloads)
            model.want()
            model.overrides = overrides
            try:
                model.restart("restarted by an admin load with new settings")
            except OperationRefused as exc:
                raise InUse(f"{model.name} is busy with another change: {exc}") from None
            task = model.operation_task
            if task is not None:
                # Not shield(task): an unload cancels the restart, and its cancellation must
                # not become this load's (its caller would get no answer at all).
                await asyncio.wait([task])
            _refuse_if_unloaded(model, unloads)
            await self._load(model, ignore_backoff=True)  # raises what the restart hit
            _refuse_if_overtaken(model, overrides, calls_off)
        finally:
            if model.overrides is overrides:
                model.overrides = Overrides()

    async def _load(self, model: Model, ignore_backoff: bool) -> None:
        model.want()
        await self._door.bring_up(model, ignore_backoff)
        filling = model.fill(model.spec.replicas_min)
        if filling is not None:
            await asyncio.shield(filling)

    async def unload(self, name: str, force: bool = False) -> str:
        """Drain (unless forced) and stop; the model ends STOPPED (requests that queued for
        it are told, not served) and stays so. The stops belong to the instances: a caller
        that hangs up stops waiting, the model still ends STOPPED."""
        model = self._herd.model(name)
        drain = 0.0 if force else self._herd.drain_seconds()
        reason = "unloaded by admin" + (" (forced)" if force else "")
        stops = model.unload(reason, drain)
        if stops:
            await asyncio.shield(asyncio.gather(*stops, return_exceptions=True))
        return model.name

    def load_soon(self, name: str) -> str:
        """Begin loading `name` as the daemon's own task (the caller does not wait): the
        shape llama.cpp's router and Open WebUI expect of POST /models/load. A failure shows
        in the model's state and last_error, and in the log."""
        model = self._herd.model(name)  # an unknown name fails now, not in the background
        if self._herd.closing:  # its task would be cancelled, or refused (ScopeClosed: 500)
            raise ShuttingDown("corral is shutting down")
        model.want()
        self._tasks.spawn(self._load_quietly(model), f"load:{model.name}")
        return model.name

    def unload_soon(self, name: str, *, admin: bool) -> str:
        """Begin draining and stopping `name` (the stops are the instances' own tasks). A
        caller without an admin key may not stop what the operator keeps loaded, nor cut
        off the requests others have in flight: it may unload an idle model it could load
        again."""
        model = self._herd.model(name)
        if not admin:
            if any(r.pinned for r in model.members):
                raise NotAllowed(f"{model.name} is kept loaded by the operator's policy; only "
                                 f"an admin key may unload it")
            if any(r.busy for r in model.members):
                raise InUse(f"{model.name} is serving requests now; only an admin key may "
                            f"unload a busy model")
        model.unload("unloaded by request", self._herd.drain_seconds())
        return model.name

    async def _load_quietly(self, model: Model) -> None:
        # Not an operator's retry (load() ignores the back-off): a client asking again and
        # again must not restart a broken model in a loop.
        try:
            await self._load(model, ignore_backoff=False)
        except Unloaded as exc:  # an unload asked after this load wins: not a failure
            log.info("daemon.load_called_off", model=model.name, reason=str(exc))
        except SupervisorError as exc:
            log.warning("daemon.load_failed", model=model.name, error=str(exc))

    async def rebalance(self, name: str) -> str:
        """Deploy a model split over RPC workers again, over every worker reachable now, with
        a new split from what each has free: drain, stop, start. The daemon's task: a client
        that hangs up does not leave the model stopped."""
        model = self._herd.model(name)
        if not model.spec.rpc_workers:
            raise NotServed(f"{name} is not split over RPC workers: nothing to rebalance")
        await self._run(self._rebalance(model), f"rebalance:{model.name}")
        return model.name

    async def _rebalance(self, model: Model) -> None:
        # An unload from now on wins: one that joins this stop must not see the model started
        # again right after it (the check and the load's own watch begin with no await).
        unloads = model.primary.unloads
        await model.primary.stop("rebalance", drain=self._herd.drain_seconds(),
                                 cause="rebalance")
        _refuse_if_unloaded(model, unloads)
        await self._load(model, ignore_backoff=True)

    async def rebalance_quietly(self, name: str) -> None:
        try:
            await self.rebalance(name)
        except Unloaded as exc:  # an unload asked meanwhile wins: not a failure
            log.info("daemon.rebalance_called_off", model=name, reason=str(exc))
        except SupervisorError as exc:  # the next request tries again
            log.warning("daemon.rebalance_failed", model=name, error=str(exc))


def _refuse_if_unloaded(model: Model, seen: int) -> None:
    if model.primary.unloads != seen:
        raise Unloaded(f"{model.name} was unloaded while this load was under way")


def _refuse_if_overtaken(model: Model, overrides: Overrides, calls_off: int) -> None:
    """A load answers 200 only over the settings it asked for: a reload that changed the
    model meanwhile ended its overrides (Model.call_off), and the child now runs the new
    config. Told by call_off itself, not by comparing what runs with what was asked: a KV
    mode of `auto` runs another cache type than the spec names, asked or not."""
    if overrides and model.called_off != calls_off:
        ready = [r for r in model.members if r.state is State.READY]
        runs = ", ".join(f"{f} {getattr(ready[0].started_with, f)}"
                         for f, _ in overrides.values) if ready else "its settings"
        raise SettingsDiffer(
            f"a reload changed {model.name} while this load was under way: it runs the new "
            f"config ({runs}), not {_said(overrides)}; load it again with \"restart\": true "
            "for these")


def _said(overrides: Overrides) -> str:
    return ", ".join(f"{f} {v}" for f, v in overrides.values)
