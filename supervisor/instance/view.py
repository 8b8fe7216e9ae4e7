"""The admin API's view of one instance (GET /admin/models): the read model's, built from
what the instance shows; the instance itself never imports it."""

from __future__ import annotations

import time
from typing import Any

from corral.supervisor.instance.core import Instance
from corral.supervisor.instance.state import LOADED_STATES
from corral.supervisor.memory.placement import gpu_index
from corral.supervisor.port import State


def rpc_state(self: Instance) -> dict[str, Any] | None:
    if not self.spec.rpc_workers:
        return None
    live = self.deployment if self.state in LOADED_STATES else None
    return {"workers": list(self.spec.rpc_workers),
            "split": list(self.spec.rpc_split) if self.spec.rpc_split else "auto",
            "deployed": live.describe() if live else None,
            "missing": list(live.missing) if live else []}

def describe(self: Instance, now_mono: float | None = None) -> dict[str, Any]:
    now = now_mono or time.monotonic()
    idle = self.idle_seconds(now)
    ttl_left = None
    if self.state is State.READY and self.spec.ttl > 0 and not self.pinned:
        # In use, the clock has not started: it runs from the last release.
        ttl_left = self.spec.ttl if self.busy else max(0.0, self.spec.ttl - idle)
    backoff = self.backoff_left(now)
    return {
        "name": self.name,
        "replica_of": self.model if self.spec.replicas_max > 1 else None,
        "replica": self.replica,
        "backend": self.spec.backend,
        "model_path": _what_it_serves(self),
        "aliases": list(self.spec.aliases),
        "state": str(self.state),
        "pid": self.pid if self.state in LOADED_STATES else None,
        "port": self.port if self.state in LOADED_STATES else None,
        "since": self.since,
        "last_used": time.time() - idle if self.starts else None,
        "in_flight": self.in_flight,
        "queue": self.queued,
        "held": self.held,
        "parallel": self.spec.parallel,
        "cache_type_k": self.started_with.cache_type_k,
        "cache_type_v": self.started_with.cache_type_v,
        # vLLM's share of each GPU it uses (None: not on a GPU, or vLLM's default)
        "gpu_memory_utilization": self.started_with.gpu_memory_utilization,
        # The GPUs (indices) its child runs on (None: not placed, or not running)
        "gpus": gpus_of(self),
        # RPC workers with the layers each holds (None: not split over workers)
        "rpc": rpc_state(self),
        "ttl": self.spec.ttl,
        "ttl_left": ttl_left,
        "pinned": self.pinned,
        "starts": self.starts,
        "restarts": self.restarts,
        "last_error": self.last_error,
        "start_failures": self.start_failures,
        "retry_at": time.time() + backoff if backoff > 0 else None,
        "health": self.health.as_dict(),
        "stop_pending": self.stop_pending,
        "prompt_cache": _prompt_cache(self),
    }


def gpus_of(self: Instance) -> list[int] | None:
    """The GPU indices a running child was placed on (None: not placed, or not running)."""
    placed = self.started_with.placed_gpus
    if self.state not in LOADED_STATES or placed is None:
        return None
    return [gpu_index(g) for g in placed]


def _what_it_serves(self: Instance) -> str:
    """The model's file, Hugging Face id, a remote's URL or a command child's executable."""
    spec = self.spec
    if spec.backend == "remote":
        return spec.url or ""
    if spec.backend == "command":
        return spec.command[0] if spec.command else ""
    return spec.model_id or str(spec.model_path)


def _prompt_cache(self: Instance) -> dict[str, Any] | None:
    """Its saved slots (files, bytes) and the slots of its child that hold a conversation."""
    cache = self._prompt_cache
    if cache is None or not self.spec.prompt_cache:
        return None
    mine = cache.store.of_model(self.model)
    slots = self.prompt_slots
    return {**mine, "slots_in_use": sum(r is not None for r in slots.records) if slots else 0}
