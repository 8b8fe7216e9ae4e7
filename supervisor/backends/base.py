"""What every backend adapter answers. Adapters build argv, describe readiness, estimate memory
and know their KV cache types; they never touch processes (that is supervisor.process's job)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from corral.supervisor.backends.binaries import BinaryNotFound
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.memory.estimate import Estimate

__all__ = ["Backend", "BinaryNotFound"]


class Backend(Protocol):
    kind: str
    # False: nothing to start (a remote endpoint); argv is never asked for.
    spawns: bool
    health_path: str
    # Ready only once /v1/models lists the model's name too (vLLM answers /health before).
    lists_models: bool
    # The child (or a process it forks) is what listens on its port: a listener outside its
    # process tree is someone else's (supervisor/listener.py). False for a command, which may
    # be a `docker run` whose port a proxy outside the tree holds.
    binds_itself: bool
    # What the child prints as it turns ready: a line containing one of these wakes the start's
    # readiness probe at once (supervisor.process.ChildProcess.wait_healthy); None: any output
    # does. Only a hint: the probe decides, and without the line it comes within POLL_S anyway.
    ready_lines: tuple[str, ...] | None

    def argv(self, spec: ModelSpec, port: int) -> list[str]:
        """The full argv (executable first) that serves `spec` on 127.0.0.1:`port`."""
        ...

    def auth_env(self, api_key: str) -> dict[str, str]:
        """Environment that makes the child require `api_key` (sent by corral as a Bearer
        token), so no other local user can use the child's port directly."""
        ...

    def env(self, spec: ModelSpec) -> dict[str, str]:
        """The model's own environment for the child, on top of the minimal one corral passes."""
        ...

    def lost_port_race(self, log_tail: list[str]) -> bool:
        """Whether a child that exited during start did so because its port was taken
        between corral picking it and the child binding it (worth one retry)."""
        ...

    def estimate(self, spec: ModelSpec, kv: tuple[str | None, str | None],
                 gpus: Sequence[str]) -> Estimate:
        """Bytes per device ("cpu", "gpu0"...) a child with these KV types will hold, from the
        model's files; raises when they cannot be read."""
        ...

    def usable_kv_steps(self, spec: ModelSpec) -> tuple[tuple[str, str], ...]:
        """The steps of the model's KV ladder its child can run."""
        ...

    def tune(self, spec: ModelSpec, need: Mapping[str, int],
             gpu_totals: Mapping[str, int]) -> ModelSpec:
        """The spec to start with, given what it needs per device and each GPU's size."""
        ...
