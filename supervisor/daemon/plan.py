"""Plan application: read the config again, diff it (supervisor/reload.py) and apply the plan
in one synchronous step; blue/green switch-overs and restarts after a stop run as tasks the
daemon owns, every state change the instance's own."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import structlog

from corral.supervisor import reload as reloading
from corral.supervisor.backends import BACKENDS
from corral.supervisor.backends.base import Backend
from corral.supervisor.config import ConfigError, ConfigIssue, LoadedConfig, load_config
from corral.supervisor.daemon.replicas import ReplicaSet
from corral.supervisor.errors import SupervisorError
from corral.supervisor.instance import LOADED_STATES, Instance, State
from corral.supervisor.runtime import Runtime, build_runtime

if TYPE_CHECKING:
    from corral.supervisor.daemon.core import Daemon

log = structlog.get_logger("corral.daemon")

# How long a config file the watcher saw change may stay empty before the reload reports it:
# an in-place save truncates first, then writes.
EMPTY_SAVE_GRACE_S = 0.5


def reload(self: Daemon, trigger: str) -> asyncio.Task[reloading.ReloadAttempt]:
    """Read the config again and apply what changed (supervisor/reload.py says what
    applies how). The work is a task the daemon owns: a caller that goes away (an HTTP
    client hanging up) only stops waiting, the reload still completes. Reloads run one
    at a time, in the order asked."""
    task: asyncio.Task[reloading.ReloadAttempt] = self._spawn_task(
        self._reload(trigger), f"reload:{trigger}")
    return task

def config_status(self: Daemon) -> dict[str, Any]:
    """The read model of GET /admin/config: the active config and the last attempt."""
    if self._config_view[0] is not self.loaded:  # built once per config, not per poll
        self._config_view = (self.loaded, reloading.config_view(self.loaded))
    return {
        "active": {**self._config_view[1], "since": self._config_since,
                   "generation": self._generation},
        "last_reload": self.last_reload.as_dict() if self.last_reload else None,
        "recent_reloads": [a.as_dict() for a in self._recent_reloads],  # oldest first
    }

def _load_source(self: Daemon) -> LoadedConfig:
    if self.loaded.source is None:
        raise ConfigError([ConfigIssue("<config>", None, "", "corral was started without a "
                                       "config file (-c): there is nothing to reload")])
    return load_config(self.loaded.source)

def _failed(self: Daemon, trigger: str, started: float, why: str,
            files: Any = None) -> reloading.ReloadAttempt:
    issue = ConfigIssue(str(self.loaded.source or "<config>"), None, "", why)
    return self._note_reload(reloading.ReloadAttempt.failed(
        trigger, started, [issue], self.loaded.files if files is None else files))

async def _reload(self: Daemon, trigger: str) -> reloading.ReloadAttempt:
    async with self._reload_lock:
        started = time.monotonic()
        self.events.publish("reloading", trigger=trigger)
        try:
            new = await self._read_config(trigger)
            # Plugins and devices, in a thread too: the config itself is data.
            runtime = await asyncio.to_thread(build_runtime, new, self.runtime, self.loaded)
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
        if _is_empty(new):
            # Still empty after the grace: not a save caught halfway, yet not a wish to
            # remove every model either; that is written `models: {}`.
            return self._failed(trigger, started,
                                "the config file is empty; not applied (write `models: {}` "
                                "to remove every model)", new.files)
        if self._closing:
            return self._failed(trigger, started, "corral is shutting down; not applied",
                                new.files)
        plan = reloading.diff(self.loaded, new, (self.runtime.kept, runtime.kept))
        changed = not plan.empty or new.digest != self.loaded.digest
        # Synchronous: applied whole, or (cancelled) not at all.
        self._apply_plan(plan, new, runtime)
        self._spawn_task(self._read_inventory(new))
        if changed:
            self._config_since = time.time()
            self._generation += 1
        return self._note_reload(reloading.ReloadAttempt.applied(trigger, started, plan, new))

async def _read_config(self: Daemon, trigger: str) -> LoadedConfig:
    """The config as the files hold it now. A file seen empty just after the watcher saw it
    change is most often a save caught between truncating and writing (an editor writing in
    place): read again for a moment rather than report a failed reload for every save."""
    # In a thread: parsing a large config must not stall the streams being relayed.
    new = await asyncio.to_thread(self._config_loader)
    waited = 0.0
    while trigger == "file" and _is_empty(new) and waited < EMPTY_SAVE_GRACE_S:
        await asyncio.sleep(0.05)
        waited += 0.05
        new = await asyncio.to_thread(self._config_loader)
    return new

def _note_reload(self: Daemon, attempt: reloading.ReloadAttempt) -> reloading.ReloadAttempt:
    self.last_reload = attempt
    self._recent_reloads.append(attempt)
    self.events.publish("reload", trigger=attempt.trigger, ok=attempt.ok,
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

def _apply_plan(self: Daemon, plan: reloading.Plan, new: LoadedConfig,
                runtime: Runtime) -> None:
    """Apply a reload plan in one synchronous step, so no request sees half of it and no
    cancellation stops it halfway. What takes time (drains, stops, restarts) goes on as
    tasks the instances and the daemon own; every state change is the instance's own."""
    drain = new.config.shutdown_grace
    # Looked up before anything changes: nothing below may fail halfway.
    backends = {c.name: BACKENDS[c.spec.backend] for c in (*plan.replace, *plan.add)}
    pinned = runtime.kept
    reader_changed = runtime.gpu_reader is not self.runtime.gpu_reader
    self.loaded, self.runtime = new, runtime
    self.memory.reconfigure(new.config.memory, runtime.gpu_reader if reader_changed else None)
    self.deployer.reconfigure(new.config.peers)
    self._memory_wake.set()  # new limits apply at once, not at the next sample
    for change in plan.update:
        rs = self.models[change.name]
        rs.primary.reconfigure(change.spec)
        rs.fit(drain, self._retire)
        if rs.incoming is not None:
            rs.incoming.reconfigure(change.spec)
    for change in plan.replace:
        rs = self.models[change.name]
        rs.kv_level = 0  # new settings start from the ladder's top
        superseded, rs.incoming = rs.incoming, None
        if superseded is not None:  # a newer change overtakes a switch-over under way
            superseded.begin_stop("superseded by a newer config change", cause="reload")
            self._retire(superseded, "superseded")
        if self._begin_switch_over(rs, change, backends[change.name], drain):
            continue
        inst = rs.primary
        inst.reconfigure(change.spec, backends[change.name], fresh_start=True)
        rs.fit(drain, self._retire, fresh_start=True)
        was_up = False
        for replica in rs.members:
            was_up |= replica.state in (State.STARTING, State.READY)
            if replica.state in LOADED_STATES:
                # Leaves READY now: new requests wait in acquire() for the restart;
                # in-flight ones get `shutdown_grace` to finish.
                replica.begin_stop("config changed: " + ", ".join(change.fields),
                                   drain=drain, cause="reload")
        # Up before, up after; and a pinned model is kept up (its old settings may be
        # what made it fail).
        if was_up or inst.name in pinned or inst.intent.restart_after_stop:
            self._restart_after(rs)
    for name in plan.remove:
        rs = self.models.pop(name)
        gone = [*rs.members, *([rs.incoming] if rs.incoming is not None else [])]
        for replica in gone:
            replica.begin_stop("removed from the config", drain=drain, cause="reload")
            self._retire(replica, "removed from the config")
    for change in plan.add:
        rs = self._new_set(change.spec, backends[change.name])
        self.models[change.name] = rs
        rs.fit(drain, self._retire)
    self._mark_kept(pinned)
    snap = self._snapshot()
    for rs in self.models.values():
        if self._decide("refuse", None, snap, rs.name):
            for replica in rs.members:
                if replica.state in (State.STARTING, State.READY):
                    replica.begin_stop(
                        f"not served under strategy {new.config.policy.strategy}",
                        drain=drain, cause="reload")
    for name in plan.pinned:
        inst = self.models[name].primary
        if inst.can_start and not inst.intent.restart_after_stop:
            self._spawn_task(self._preload(inst))
    self._changed.fire()

def _begin_switch_over(self: Daemon, rs: ReplicaSet, change: reloading.ModelChange,
                       backend: Backend, drain: float) -> bool:
    """Blue/green for a ready model whose child-affecting settings changed: start the new
    child beside the old one (which keeps serving) when the strategy finds room for both
    without evicting anything; once it is ready, it takes the model's name and the old one
    drains. False (the caller restarts in place) for replicas, a model not serving now,
    or no room."""
    old = rs.primary
    if old.spec.replicas_max > 1 or change.spec.replicas_max > 1 \
            or old.state is not State.READY or self._closing:
        return False
    fresh = self._new_instance(change.spec, backend)
    rs.incoming = fresh  # seen by the strategy, as "<model> (new)"
    snap = self._snapshot()
    placement = self._decide("place", None, snap, f"{rs.name} (new)")
    if placement is None or not placement.fits:
        rs.incoming = None
        return False
    fresh.set_pinned(old.pinned)
    self._begin_start(fresh, snap, f"{rs.name} (new)",
                      reason="switch-over: " + ", ".join(change.fields))
    log.info("daemon.switch_over_started", model=rs.name, old_pid=old.pid,
             fields=list(change.fields))
    self._spawn_task(self._switch_over(rs, old, fresh, change, drain))
    return True

async def _switch_over(self: Daemon, rs: ReplicaSet, old: Instance, fresh: Instance,
                       change: reloading.ModelChange, drain: float) -> None:
    name = rs.name
    try:
        await fresh.wait_ready()
    except (SupervisorError, asyncio.CancelledError) as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the daemon is closing: close() stops every child
        if rs.incoming is not fresh:
            return  # superseded or removed: whoever did that took over
        rs.incoming = None
        old.intent.for_kv = False
        fresh.begin_stop("its switch-over failed", cause="reload")
        self._retire(fresh, "its switch-over failed")
        log.warning("daemon.switch_over_failed", model=name, error=str(exc),
                    old_pid=old.pid, note="the previous child keeps serving")
        if self.models.get(name) is rs and rs.primary is old:
            # Nothing fails: the old child goes on serving. It takes the new settings, so
            # its next start uses them (and shows their failure); admin shows why now.
            old.reconfigure(fresh.spec, fresh.backend)
            old.last_error = (f"the new settings ({', '.join(change.fields)}) failed to "
                              f"start: {exc}; the previous child keeps serving")
        return
    if rs.incoming is not fresh or self.models.get(name) is not rs \
            or rs.primary is not old or self._closing:
        fresh.begin_stop("superseded before it was switched in", cause="reload")
        self._retire(fresh, "superseded")
        if rs.incoming is fresh:
            rs.incoming = None
        old.intent.for_kv = False
        return
    rs.incoming = None
    old.intent.for_kv = False
    fresh.touch(old.last_used)
    fresh.set_pinned(old.pinned)
    rs.primary = fresh
    old.begin_stop("replaced by its new child (config changed: "
                   + ", ".join(change.fields) + ")", drain=drain, cause="reload")
    old.wake_waiters()  # requests queued on the old child go to the new one
    self._retire(old, "replaced by its new child")
    log.info("daemon.switched_over", model=name, old_pid=old.pid, pid=fresh.pid)
    self._persist_children()
    self._changed.fire()

def _restart_after(self: Daemon, rs: ReplicaSet) -> None:
    """A model that was up when its child-affecting settings changed is up again after:
    once its stops have ended, start it with the new spec. Requests that waited meanwhile
    may start it first; this then shares that start."""
    inst = rs.primary
    if inst.intent.restart_after_stop:
        return  # a restart already waits for this stop; it reads the newest spec
    inst.intent.restart_after_stop = True

    async def restart() -> None:
        try:
            try:
                while any(m.stop_pending for m in rs.members):
                    await self._changed.wait(1.0)
            finally:
                inst.intent.restart_after_stop = False
            if self.models.get(inst.model) is rs and rs.primary is inst \
                    and not self._closing and inst.can_start:
                try:
                    await self.load(inst.model)
                except SupervisorError as exc:
                    # Its next request tries again; /admin/models shows why.
                    log.error("daemon.restart_failed", model=inst.name, error=str(exc))
        finally:
            inst.intent.for_kv = False
            self._changed.fire()

    self._spawn_task(restart(), f"restart:{inst.name}")


def _is_empty(loaded: LoadedConfig) -> bool:
    """A config file with no top-level key at all (the embedded default has no file)."""
    return loaded.source is not None and not any(len(loc) == 1 for loc in loaded.lines)
