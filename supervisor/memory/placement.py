"""Which GPUs a child runs on, on a box with several: pure decisions over the `MemoryView`.

A model whose estimate fits one GPU runs on one: by default the one it leaves least free
("best-fit": big holes stay for big models), `memory.gpu_placement: most-free` for the other
way round. A model that fits no single GPU gets the fewest that fit it, those with the most
room, its layers split in proportion to their room (llama.cpp's `--tensor-split`). A vLLM
model gets exactly tensor_parallel_size × pipeline_parallel_size GPUs. A GPU at or above the
critical watermark takes no new load while another can. Replicas of one model go first to
GPUs none of their siblings is on. Room is counted as placement counts it (the pool's
capacity on that GPU less what others there hold): first as things are, then as if every
idle model there were evicted, then with nothing loaded; the first of those where the model
fits decides, so eviction frees memory on the GPUs the load will use, not elsewhere.

`GpuPlacement` is the strategy's side (BaseStrategy inherits it): it reads the snapshot and
asks `choose_gpus`; a strategy plugin may override `gpus_for`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from corral.supervisor.memory.view import Footprint, MemoryView, mib

if TYPE_CHECKING:
    from corral.supervisor.policy import KvCache, Snapshot

__all__ = ["GpuChoice", "GpuPlacement", "choose_gpus", "gpu_index", "tensor_split"]


@dataclass(frozen=True)
class GpuChoice:
    """The GPUs one start uses, in the order the child sees them, and each one's share of
    the layers (percent; empty on one GPU)."""

    gpus: tuple[str, ...]
    split: tuple[int, ...] = ()

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(gpu_index(g) for g in self.gpus)


def gpu_index(name: str) -> int:
    """3 for "gpu3"; -1 for a name that is not a GPU's."""
    digits = name.removeprefix("gpu")
    return int(digits) if name.startswith("gpu") and digits.isdigit() else -1


def tensor_split(rooms: Sequence[int]) -> tuple[int, ...]:
    """Percent shares in proportion to `rooms` (each at least 1; equal when none has room)."""
    total = sum(max(0, r) for r in rooms)
    if total <= 0:
        return tuple(1 for _ in rooms)
    return tuple(max(1, round(100 * max(0, r) / total)) for r in rooms)


def choose_gpus(mem: MemoryView, allowed: Sequence[str], count: int,
                need_on: Callable[[GpuChoice], Footprint],
                tiers: Sequence[Mapping[str, int]], siblings: Mapping[str, int],
                rule: str = "best-fit", restarting: bool = False) -> GpuChoice | None:
    """The GPUs for one start, or None when it uses none (a CPU model, no GPU known).

    allowed: the GPUs it may use, in order; count: exactly this many (0: the fewest that
    fit; len(allowed): all of them, in that order); need_on: what it takes on a choice;
    tiers: room per GPU to try in turn (as things are, after evictions, with nothing
    loaded); siblings: its own replicas per GPU."""
    gpus = [g for g in allowed if g in mem.devices and mem.devices[g].kind == "gpu"]
    if not gpus:
        return None
    # A count of its own (vLLM's parallel size, the GPUs the model's env names): the runtime
    # splits the model over them its own way (vLLM evenly), so no split of corral's.
    if count and count >= len(allowed) and len(gpus) == len(allowed):
        return GpuChoice(tuple(allowed))
    probe = need_on(GpuChoice((gpus[0],)))
    if not any(n > 0 for d, n in probe.items() if d in mem.devices
               and mem.devices[d].kind == "gpu"):
        return None
    # A GPU past the critical watermark takes no new load while another can (a restart
    # at another KV step frees memory: it may).
    usable = [g for g in gpus if restarting
              or mem.devices[g].used_pct < mem.critical_watermark]
    if len(usable) < max(count, 1):
        # Too few below the watermark for what the runtime needs (vLLM's parallel size):
        # all of them rather than a choice that cannot start.
        usable = gpus
    sizes = [count] if count else list(range(1, len(usable) + 1))
    for rooms in tiers:
        for k in sizes:
            if k > len(usable):
                break
            found = _best(_candidates(usable, k, rooms, not count), need_on, rooms,
                          siblings, rule)
            if found is not None:
                return found
    k = min(count or len(usable), len(usable))
    return _widest(usable, k, tiers[-1], not count)


def _candidates(usable: list[str], k: int, rooms: Mapping[str, int],
                split: bool) -> list[GpuChoice]:
    if k == 1:
        return [GpuChoice((g,)) for g in usable]
    return [_widest(usable, k, rooms, split)]


def _widest(usable: list[str], k: int, rooms: Mapping[str, int], split: bool) -> GpuChoice:
    """The k GPUs with the most room, in index order, split by their room (`split`)."""
    top = sorted(sorted(usable, key=lambda g: (-rooms.get(g, 0), gpu_index(g)))[:k],
                 key=gpu_index)
    return GpuChoice(tuple(top), tensor_split([rooms.get(g, 0) for g in top])
                     if split and k > 1 else ())


def _best(candidates: list[GpuChoice], need_on: Callable[[GpuChoice], Footprint],
          rooms: Mapping[str, int], siblings: Mapping[str, int],
          rule: str) -> GpuChoice | None:
    fitting: list[tuple[int, int, int, GpuChoice]] = []
    for choice in candidates:
        need = need_on(choice)
        if all(need.get(g, 0) <= rooms.get(g, 0) for g in choice.gpus):
            left = sum(rooms.get(g, 0) - need.get(g, 0) for g in choice.gpus)
            fitting.append((sum(siblings.get(g, 0) for g in choice.gpus),
                            left if rule == "best-fit" else -left,
                            min(gpu_index(g) for g in choice.gpus), choice))
    return min(fitting, key=lambda f: f[:3])[3] if fitting else None


class GpuPlacement:
    """The strategy's side of placement across devices (BaseStrategy inherits it): which
    GPUs a start uses, and whether several models fit together."""

    def kept_views(self, snap: Snapshot) -> frozenset[str]:
        raise NotImplementedError  # BaseStrategy's

    def need(self, snap: Snapshot, model: str, kv: KvCache | None = None,
             extra: Mapping[str, int] | None = None) -> Footprint:
        raise NotImplementedError  # BaseStrategy's

    def memory_room_for(self, snap: Snapshot, models: frozenset[str]) -> str | None:
        """None when `models` fit in memory together (what is loaded at what it holds, the
        rest at what it would take), each in its budget."""
        mem = snap.memory
        if mem is None or snap.estimate is None:
            return None
        total: dict[tuple[str | None, str], int] = {}
        planned: dict[str | None, dict[str, int]] = {}  # pool → what the plan placed
        for model in sorted(models):
            view = snap.view(model)
            pool = mem.pool_of(snap.groups, snap.model_of(model))
            # One not loaded goes where the models placed before it leave room.
            footprint = view.footprint if view is not None and view.loaded \
                else self.need(snap, model, extra=planned.setdefault(pool, {}))
            for device_name, n in footprint.items():
                total[(pool, device_name)] = total.get((pool, device_name), 0) + n
                if view is None or not view.loaded:
                    planned[pool][device_name] = planned[pool].get(device_name, 0) + n
        for (pool, device_name), n in sorted(total.items(), key=lambda kv: str(kv[0])):
            found = mem.devices.get(device_name)
            if found is None:
                continue
            capacity = mem.pool_capacity(found, pool)
            if n > capacity:
                where = f"group {pool}'s budget" if pool else "the shared budget"
                return (f"needs {mib(n)} on {device_name} for {', '.join(sorted(models))} "
                        f"at once but {where} there is {mib(capacity)}")
        return None

    def gpus_for(self, snap: Snapshot, model: str, kv: KvCache | None,
                 extra: Mapping[str, int] | None = None) -> GpuChoice | None:
        """The GPUs `model` (a view's name) would start on now with `kv`; None: it is not
        placed (no GPUs, a CPU model, a snapshot without per-GPU estimates). `extra`:
        bytes per GPU to count as held besides what is loaded (models placed before it in
        the same plan)."""
        mem, estimate_on = snap.memory, snap.estimate_on
        view = snap.view(model)
        if view is None or view.gpu_count < 0:
            return None
        # A pinned model runs on its GPUs even where corral cannot weigh them (no reading
        # yet, GPUs the reader does not see, a child that holds no GPU memory it knows of).
        pinned = GpuChoice(view.gpus) if view.gpus else None
        if mem is None or estimate_on is None:
            return pinned
        gpus = sorted((d.name for d in mem.devices.values() if d.kind == "gpu"),
                      key=gpu_index)
        allowed = list(view.gpus) if view.gpus else gpus
        pool = mem.pool_of(snap.groups, snap.model_of(model))
        restarting = view.kv_changing
        kept = self.kept_views(snap)
        held: dict[str, int] = dict(extra or {})
        idle: dict[str, int] = {}
        siblings: dict[str, int] = {}
        base = snap.model_of(model)
        for other in snap.loaded:
            if other.name == model:
                continue
            if snap.model_of(other.name) == base:
                for g in gpus:
                    siblings[g] = siblings.get(g, 0) + (other.footprint.get(g, 0) > 0)
            if mem.pool_of(snap.groups, snap.model_of(other.name)) != pool:
                continue
            for g in gpus:
                n = other.footprint.get(g, 0)
                held[g] = held.get(g, 0) + n
                if other.stoppable and other.name not in kept:
                    idle[g] = idle.get(g, 0) + n
        caps = {g: mem.pool_capacity(mem.devices[g], pool, ceiling=not restarting)
                for g in gpus}
        tiers = [{g: max(0, caps[g] - held.get(g, 0)) for g in gpus},
                 {g: max(0, caps[g] - held.get(g, 0) + idle.get(g, 0)) for g in gpus},
                 caps]

        def need_on(choice: GpuChoice) -> Footprint:
            return estimate_on(model, kv, choice)

        return choose_gpus(mem, allowed, view.gpu_count, need_on, tiers, siblings,
                           mem.gpu_placement, restarting) or pinned
