"""A configured model's lifecycle, in words the read model shows: the operator's wish and the
model's state over its instances, with the transitions the model's own operations may make."""

from __future__ import annotations

from enum import StrEnum


class Wish(StrEnum):
    """What the model should be, as asked: by the operator (load, unload), by requests, and by
    the policy that keeps it loaded (the pin)."""

    ABSENT = "absent"  # unloaded, or never asked for: nothing brings it up but a request
    LOADED = "loaded"  # asked for (a request, a load): up until TTL, eviction or an unload
    PINNED = "pinned"  # the policy keeps it loaded: brought back whenever it is down


class ModelState(StrEnum):
    """The model over its instances, and the operation under way, if any."""

    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    SWITCHING = "switching"  # blue/green: a new child starts beside the one that serves
    STEPPING_KV = "stepping_kv"  # restarting at another step of its KV ladder
    RESTARTING = "restarting"  # a reload restarts it in place: drain, stop, start
    DRAINING = "draining"
    STOPPING = "stopping"
    FAILED = "failed"


# The operations a model runs (one at a time) and what may replace one under way. An unload
# is not in the table: it wins over any of them (it cancels what runs), from any state.
OPERATIONS = frozenset({ModelState.SWITCHING, ModelState.STEPPING_KV, ModelState.RESTARTING})
REPLACES: dict[ModelState | None, frozenset[ModelState]] = {
    None: OPERATIONS,
    # A newer config change overtakes a switch-over or a restart under way; a KV step never
    # overtakes a reload's change (memory pressure waits for it to end).
    ModelState.SWITCHING: frozenset({ModelState.SWITCHING, ModelState.RESTARTING}),
    ModelState.RESTARTING: frozenset({ModelState.SWITCHING, ModelState.RESTARTING}),
    ModelState.STEPPING_KV: frozenset({ModelState.SWITCHING, ModelState.RESTARTING}),
}


class OperationRefused(RuntimeError):
    """An operation was asked from a state the table does not allow it from."""
