"""`backend: command`: any OpenAI-compatible server, started from the model's own argv with the
port corral picked in place of ${PORT}. corral knows nothing of its model files: its memory is
`memory_mb` until measured, and it has no KV cache types to choose."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.memory.estimate import Estimate

__all__ = ["PORT_MACRO", "Command"]

# Left alone by the YAML loader's ${VAR} expansion (config/yaml.py RESERVED).
PORT_MACRO = "${PORT}"
# Where a command child finds the API key corral sends it.
CHILD_KEY_ENV = "CORRAL_CHILD_API_KEY"
MIB = 1 << 20
# What servers built on uvicorn, cpp-httplib, Go's net/http and Node say when the port is taken.
_PORT_TAKEN = re.compile(r"address already in use|couldn't bind|error while attempting to bind"
                         r"|EADDRINUSE", re.I)


class Command:
    kind = "command"
    spawns = True
    # The spec's health_path decides (default /health; None: the port accepting connections).
    health_path = "/health"
    lists_models = False
    binds_itself = False
    # Any server at all: whatever it prints may be its "listening" line.
    ready_lines: tuple[str, ...] | None = None

    def argv(self, spec: ModelSpec, port: int) -> list[str]:
        return [arg.replace(PORT_MACRO, str(port)) for arg in spec.command]

    def auth_env(self, api_key: str) -> dict[str, str]:
        # The key corral sends this child (Authorization: Bearer), for a server that can be
        # told to require one: in its environment, never its argv (every local user reads
        # argv in ps), e.g. `sh -c 'API_KEY="$CORRAL_CHILD_API_KEY" exec server ...'`. A
        # server that reads none is guarded by nothing but 127.0.0.1 (docs/backends.md).
        return {CHILD_KEY_ENV: api_key}

    def env(self, spec: ModelSpec) -> dict[str, str]:
        return dict(spec.env)

    def lost_port_race(self, log_tail: list[str]) -> bool:
        return any(_PORT_TAKEN.search(line) for line in log_tail)

    def estimate(self, spec: ModelSpec, kv: tuple[str | None, str | None],
                 gpus: Sequence[str]) -> Estimate:
        """`memory_mb` in RAM, or nothing (not counted until the running child is measured)."""
        nbytes = int(spec.memory_mb * MIB) if spec.memory_mb else 0
        return Estimate(devices={"cpu": nbytes} if nbytes else {}, weights=nbytes, kv=0,
                        compute=0, overhead=0, source="memory_mb" if nbytes else "none")

    def usable_kv_steps(self, spec: ModelSpec) -> tuple[tuple[str, str], ...]:
        return ()

    def tune(self, spec: ModelSpec, need: Mapping[str, int],
             gpu_totals: Mapping[str, int]) -> ModelSpec:
        return spec
