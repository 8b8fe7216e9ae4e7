"""How a model's layers are split over RPC workers: pure arithmetic on the GGUF facts and each
worker's measured free memory, so it is easy to test and to show (/admin/models/{name}/gguf)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from corral.supervisor.memory.estimate import ModelFacts, kv_bytes

__all__ = ["HEADROOM", "NoFit", "SplitPlan", "layer_need", "plan_split"]

# Of a worker's free memory, the share layers may take: the rest is for its compute buffer
# and for whatever else starts on that machine meanwhile.
HEADROOM = 0.9


class NoFit(Exception):
    """The workers cannot hold the model's layers; the message says by how much."""


@dataclass(frozen=True)
class SplitPlan:
    layers: tuple[int, ...]  # layers per worker, in the workers' order (--tensor-split)
    layer_bytes: int  # what one layer takes: its weights plus its KV at the model's ctx
    free: tuple[int, ...]  # each worker's free bytes, as measured


def layer_need(facts: ModelFacts, ctx: int, parallel: int, type_k: str | None,
               type_v: str | None) -> int:
    """The bytes of the heaviest layer: its tensors plus its share of the KV cache."""
    n_ctx = ctx or facts.n_ctx_train
    kv = kv_bytes(facts, n_ctx, type_k or "f16", type_v or "f16", parallel=parallel)
    return max(facts.layer_bytes, default=0) + kv // max(1, facts.n_layer)


def plan_split(n_layer: int, layer_bytes: int, free: Sequence[int],
               weights: Sequence[float] | None = None) -> SplitPlan:
    """Layers per worker: in proportion to `weights` (default: each worker's free memory),
    no worker past what its free memory holds (less HEADROOM). NoFit when all of them
    together cannot hold `n_layer` layers."""
    if not free:
        raise NoFit("no workers")
    capacity = [int(f * HEADROOM) // max(1, layer_bytes) for f in free]
    if sum(capacity) < n_layer:
        mib = 1024 * 1024
        raise NoFit(
            f"{n_layer} layers of {layer_bytes / mib:.1f} MiB need "
            f"{n_layer * layer_bytes / mib:.0f} MiB; the workers hold "
            f"{sum(capacity)} layers ({', '.join(f'{f / mib:.0f}' for f in free)} MiB free)")
    share = list(weights) if weights is not None else [float(f) for f in free]
    total = sum(share) or 1.0
    ideal = [n_layer * s / total for s in share]
    layers = [min(int(x), cap) for x, cap in zip(ideal, capacity, strict=True)]
    # Hand out what rounding and the caps left over: to the worker furthest below its share
    # that still has room.
    while sum(layers) < n_layer:
        room = [i for i in range(len(layers)) if layers[i] < capacity[i]]
        pick = max(room, key=lambda i: (ideal[i] - layers[i], capacity[i] - layers[i]))
        layers[pick] += 1
    return SplitPlan(tuple(layers), layer_bytes, tuple(free))
