"""One schedulable unit's state machine: state and compare-and-swap transitions, slots and
leases, its start (a Launch) and its watch (a ChildWatch) (DESIGN: supervisor/instance/)."""

from corral.supervisor.instance.core import Instance, owned_task
from corral.supervisor.instance.state import (
    LOADED_STATES,
    STARTABLE,
    Changed,
    Health,
    IllegalTransition,
)
from corral.supervisor.port import Lease, State

__all__ = ["LOADED_STATES", "STARTABLE", "Changed", "Health", "IllegalTransition", "Instance",
           "Lease", "State", "owned_task"]
