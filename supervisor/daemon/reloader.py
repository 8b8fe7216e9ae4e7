"""The reloader: read the config again, diff it (supervisor/reload.py) and apply the plan in
one synchronous step, as transitions of the models it changes (a restart in place, a
blue/green switch-over, replicas, the pin); what takes time runs as the models' tasks."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from corral.supervisor import reload as reloading
from corral.supervisor.backends import BACKENDS
from corral.supervisor.config import ConfigError, ConfigIssue, LoadedConfig, load_config
from corral.supervisor.daemon.herd import Herd
from corral.supervisor.daemon.lifecycle import Lifecycle
from corral.supervisor.daemon.planner import Planner
from corral.supervisor.events import EventBus
from corral.supervisor.instance import LOADED_STATES, State
from corral.supervisor.memory.tracker import MemoryTracker
from corral.supervisor.rpc.deploy import RpcDeployer
from corral.supervisor.runtime import Runtime, build_runtime
from corral.supervisor.tasks import TaskScope

log = structlog.get_logger("corral.daemon")

# How long a config file the watcher saw change may stay empty before the reload reports it:
# an in-place save truncates first, then writes.
EMPTY_SAVE_GRACE_S = 0.5

# What the reloader asks of others when a config is adopted: new limits for the memory loop,
# the new config's model files read (inventory).
Adopted = Callable[[LoadedConfig], None]


class Reloader:
    def __init__(self, herd: Herd, planner: Planner, lifecycle: Lifecycle,
                 memory: MemoryTracker, deployer: RpcDeployer, events: EventBus,
                 tasks: TaskScope, adopted: Adopted,
                 config_loader: Callable[[], LoadedConfig] | None = None):
        self._herd = herd
        self._planner = planner
        self._lifecycle = lifecycle
        self._memory = memory
        self._deployer = deployer
        self._events = events
        self._tasks = tasks
        self._adopted = adopted
        # How to read the config again (runs in a thread), one reload at a time.
        self._config_loader = config_loader or self._load_source
        self._lock = asyncio.Lock()
        self.last_reload: reloading.ReloadAttempt | None = None
        self.recent: collections.deque[reloading.ReloadAttempt] = collections.deque(maxlen=20)
        self._config_since = time.time()
        self._generation = 1
        self._config_view: tuple[LoadedConfig | None, dict[str, Any]] = (None, {})

    def reload(self, trigger: str) -> asyncio.Task[reloading.ReloadAttempt]:
        """Read the config again and apply what changed (supervisor/reload.py says what
        applies how). The work is a task the daemon owns: a caller that goes away (an HTTP
        client hanging up) only stops waiting, the reload still completes. Reloads run one
        at a time, in the order asked."""
        return self._tasks.spawn(self._reload(trigger), f"reload:{trigger}")

    def config_status(self) -> dict[str, Any]:
        """The read model of GET /admin/config: the active config and the last attempt."""
        if self._config_view[0] is not self._herd.loaded:  # built once per config, not per poll
            self._config_view = (self._herd.loaded,
                                 reloading.config_view(self._herd.loaded))
        return {
            "active": {**self._config_view[1], "since": self._config_since,
                       "generation": self._generation},
            "last_reload": self.last_reload.as_dict() if self.last_reload else None,
            "recent_reloads": [a.as_dict() for a in self.recent],  # oldest first
        }

    def _load_source(self) -> LoadedConfig:
        if self._herd.loaded.source is None:
            raise ConfigError([ConfigIssue("<config>", None, "", "corral was started without a "
                                           "config file (-c): there is nothing to reload")])
        return load_config(self._herd.loaded.source)

    def _failed(self, trigger: str, started: float, why: str,
                files: Any = None) -> reloading.ReloadAttempt:
        issue = ConfigIssue(str(self._herd.loaded.source or "<config>"), None, "", why)
        return self._note_reload(reloading.ReloadAttempt.failed(
            trigger, started, [issue], self._herd.loaded.files if files is None else files))

    async def _reload(self, trigger: str) -> reloading.ReloadAttempt:
        async with self._lock:
            started = time.monotonic()
            self._events.publish("reloading", trigger=trigger)
            try:
                new = await self._read_config(trigger)
                # Plugins and devices, in a thread too: the config itself is data.
                runtime = await asyncio.to_thread(build_runtime, new, self._herd.runtime,
                                                self._herd.loaded)
            except ConfigError as exc:
                return self._note_reload(reloading.ReloadAttempt.failed(
                    trigger, started, exc.issues, exc.files))
            except asyncio.CancelledError:
                # Shutdown, mid-read: a reader that saw `reloading` also sees how it ended.
                self._failed(trigger, started, "cancelled: corral is shutting down; not applied")
                raise
            except Exception as exc:  # a bug while loading: report it, keep serving
                log.exception("daemon.reload_crashed", trigger=trigger)
                return self._failed(trigger, started,
                                     f"reload failed: {type(exc).__name__}: {exc}")
            if _emptied_main(new, self._herd.loaded):
                # Still empty after the grace: not a save caught halfway, yet not a wish to
                # remove every model either; that is written `models: {}`. (A file empty from
                # the start is a config of defaults: the models folder beside it.)
                return self._failed(trigger, started,
                                    "the config file is empty; not applied (write `models: {}` "
                                    "to remove every model)", new.files)
            emptied = _emptied(new, self._herd.loaded)
            if emptied:
                # An included file that held models or settings, found empty after the grace:
                # applied, every model it held would drain and stop, to start again at the
                # save's next write; emptying it on purpose is written `{}`.
                return self._failed(trigger, started,
                                    f"the included file {emptied[0]} is empty; not applied "
                                    "(write `{}` in it to empty it on purpose)", new.files)
            if self._herd.closing:
                return self._failed(trigger, started, "corral is shutting down; not applied",
                                    new.files)
            plan = reloading.diff(self._herd.loaded, new,
                                  (self._herd.runtime.kept, runtime.kept))
            changed = not plan.empty or new.digest != self._herd.loaded.digest
            # Synchronous: applied whole, or (cancelled) not at all.
            self._apply_plan(plan, new, runtime)
            self._adopted(new)
            if changed:
                self._config_since = time.time()
                self._generation += 1
            return self._note_reload(reloading.ReloadAttempt.applied(trigger, started, plan, new))

    async def _read_config(self, trigger: str) -> LoadedConfig:
        """The config as the files hold it now. A file seen empty just after the watcher saw it
        change is most often a save caught between truncating and writing (an editor writing in
        place): read again for a moment rather than report a failed reload for every save."""
        # In a thread: parsing a large config must not stall the streams being relayed.
        new = await asyncio.to_thread(self._config_loader)
        waited = 0.0
        while trigger == "file" and (_emptied_main(new, self._herd.loaded)
                                     or _emptied(new, self._herd.loaded)) \
                and waited < EMPTY_SAVE_GRACE_S:
            await asyncio.sleep(0.05)
            waited += 0.05
            new = await asyncio.to_thread(self._config_loader)
        return new

    def _note_reload(self, attempt: reloading.ReloadAttempt) -> reloading.ReloadAttempt:
        self.last_reload = attempt
        self.recent.append(attempt)
        self._events.publish("reload", trigger=attempt.trigger, ok=attempt.ok,
                            ms=attempt.duration_ms, changes=attempt.changes,
                            issues=[str(i) for i in attempt.issues])
        if attempt.ok:
            log.info("daemon.reload", trigger=attempt.trigger, hash=attempt.digest[:12],
                     ms=attempt.duration_ms, **(attempt.changes or {}))
            if attempt.changes and attempt.changes["needs_restart"]:
                log.warning("daemon.reload_needs_restart", keys=attempt.changes["needs_restart"],
                            note="these settings apply when corral is restarted")
        else:
            log.error("daemon.reload_failed", trigger=attempt.trigger,
                      issues=[str(i) for i in attempt.issues],
                      note="the running config stays active")
        return attempt

    def _apply_plan(self, plan: reloading.Plan, new: LoadedConfig, runtime: Runtime) -> None:
        """Apply a reload plan in one synchronous step, so no request sees half of it and no
        cancellation stops it halfway. What takes time (drains, stops, restarts) goes on as
        tasks the instances and the models own; every state change is theirs."""
        herd, lifecycle = self._herd, self._lifecycle
        drain = new.config.shutdown_grace
        # Looked up before anything changes: nothing below may fail halfway.
        backends = {c.name: BACKENDS[c.spec.backend] for c in (*plan.replace, *plan.add)}
        pinned = runtime.kept
        reader_changed = runtime.gpu_reader is not herd.runtime.gpu_reader
        herd.loaded, herd.runtime = new, runtime
        self._memory.reconfigure(new.config.memory,
                                 runtime.gpu_reader if reader_changed else None)
        self._deployer.reconfigure(new.config.peers)
        for change in plan.update:
            model = herd.models[change.name]
            model.primary.reconfigure(change.spec)
            model.fit(drain)
            if model.incoming is not None:
                model.incoming.reconfigure(change.spec)
        for change in plan.replace:
            model = herd.models[change.name]
            model.kv_level = 0  # new settings start from the ladder's top
            # A restart or switch-over already under way: its model comes back (or goes on).
            was_restarting = model.restarting or model.incoming is not None
            model.call_off("superseded by a newer config change")
            if model.switch_over(change.spec, backends[change.name], change.fields):
                continue
            inst = model.primary
            inst.reconfigure(change.spec, backends[change.name], fresh_start=True)
            model.fit(drain, fresh_start=True)
            was_up = any(r.state in (State.STARTING, State.READY) for r in model.members)
            # Up before, up after; and a pinned model is kept up (its old settings may be
            # what made it fail). New requests wait in acquire() for the restart; in-flight
            # ones get `shutdown_grace` to finish.
            why = "config changed: " + ", ".join(change.fields)
            if was_up or was_restarting or inst.name in pinned:
                model.restart(why)
            else:
                for replica in model.members:
                    if replica.state in LOADED_STATES:
                        replica.begin_stop(why, drain=drain, cause="reload")
        for name in plan.remove:
            model = herd.models.pop(name)
            model.forget()
            for replica in model.everyone():
                replica.begin_stop("removed from the config", drain=drain, cause="reload")
                # Requests queued for its slots are told now, not once the drain has ended
                # (it serves no one again: a later config that names the model makes anew).
                replica.wake_waiters()
                herd.retire(replica, "removed from the config")
            model.incoming = None
        for change in plan.add:
            model = lifecycle.new_model(change.spec)
            herd.models[change.name] = model
            model.fit(drain)
        herd.mark_kept(pinned)
        snap = self._planner.snapshot()
        for model in herd.models.values():
            if self._planner.decide("refuse", None, snap, model.name):
                for replica in model.members:
                    if replica.state in (State.STARTING, State.READY):
                        replica.begin_stop(
                            f"not served under strategy {new.config.policy.strategy}",
                            drain=drain, cause="reload")
        for name in plan.pinned:
            herd.models[name].pin_anew()
        herd.changed.fire()


def _emptied(new: LoadedConfig, active: LoadedConfig) -> list[Path]:
    """The included files that hold no YAML now, and held some in the active config (an
    include that was empty from the start, a placeholder, stays acceptable)."""
    if not new.empty_files:
        return []
    return [path for path in new.files[1:]
            if path in new.empty_files and path in active.files
            and path not in active.empty_files]


def _emptied_main(new: LoadedConfig, active: LoadedConfig) -> bool:
    """The config file holds no YAML now, and held some in the active config."""
    return _is_empty(new) and not _is_empty(active)


def _is_empty(loaded: LoadedConfig) -> bool:
    """A config file with no top-level key at all (the embedded default has no file)."""
    return loaded.source is not None and not any(len(loc) == 1 for loc in loaded.lines)
