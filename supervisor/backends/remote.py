"""`backend: remote`: an OpenAI-compatible endpoint that runs elsewhere. No process, no memory
here: its instance is "up" at once and leases point at `url` with its API key (instance/start.py
branches on `spawns`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.memory.estimate import Estimate

__all__ = ["Remote"]


class Remote:
    kind = "remote"
    spawns = False
    health_path = "/health"  # unused: a remote is not probed (its requests tell its health)
    lists_models = False
    binds_itself = False  # unused: nothing is started
    ready_lines: tuple[str, ...] | None = None  # unused: nothing is started

    def argv(self, spec: ModelSpec, port: int) -> list[str]:
        raise TypeError(f"{spec.name}: a remote model has no process to start")

    def auth_env(self, api_key: str) -> dict[str, str]:
        return {}

    def env(self, spec: ModelSpec) -> dict[str, str]:
        return {}

    def lost_port_race(self, log_tail: list[str]) -> bool:
        return False

    def estimate(self, spec: ModelSpec, kv: tuple[str | None, str | None],
                 gpus: Sequence[str]) -> Estimate:
        return Estimate(devices={}, weights=0, kv=0, compute=0, overhead=0, source="remote")

    def usable_kv_steps(self, spec: ModelSpec) -> tuple[tuple[str, str], ...]:
        return ()

    def tune(self, spec: ModelSpec, need: Mapping[str, int],
             gpu_totals: Mapping[str, int]) -> ModelSpec:
        return spec

    def headers(self, spec: ModelSpec) -> dict[str, str]:
        return {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
