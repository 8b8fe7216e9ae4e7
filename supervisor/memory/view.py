"""What the policy sees of memory: each device's sampled state and corral's limits on it.
Pure values and arithmetic (no reads): the daemon builds a `MemoryView` from the latest sample
and the config; strategies decide from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["MIB", "DeviceView", "Footprint", "MemoryView", "mib"]

MIB = 1024 * 1024
Footprint = Mapping[str, int]  # device name ("cpu", "gpu0", ...) → bytes


def mib(n: float) -> str:
    return f"{n / MIB:.0f} MiB"


@dataclass(frozen=True)
class DeviceView:
    name: str
    kind: str  # "cpu" | "gpu"
    total: int
    used: int  # sampled: everyone's, corral's children included
    ours: int  # what corral's children held at that sample (measured)
    reserve: int  # never handed out
    budget: int | None  # cap on what corral's children may take here (None: all)

    @property
    def other(self) -> int:
        """What processes other than corral's children hold."""
        return max(0, self.used - self.ours)

    @property
    def used_pct(self) -> float:
        return 100.0 * self.used / self.total if self.total else 0.0

    @property
    def capacity(self) -> int:
        """What corral's children may hold here in all: the device less the reserve and what
        others use, capped by the budget."""
        room = self.total - self.reserve - self.other
        return max(0, min(room, self.budget) if self.budget is not None else room)


@dataclass(frozen=True)
class MemoryView:
    devices: Mapping[str, DeviceView]
    low_watermark: float  # % used
    critical_watermark: float
    budgets: Mapping[str, int] = field(default_factory=dict)  # group → bytes, per device
    # Seconds every device has stayed below the low watermark (0 while one is above it).
    calm_for: float = 0.0
    gpu_placement: str = "best-fit"  # or "most-free": see memory/placement.py

    def pool_of(self, groups: Mapping[str, tuple[str, ...]], model: str) -> str | None:
        """The budgeted group whose budget `model` lives in (None: the shared rest)."""
        for group in self.budgets:
            if model in groups.get(group, ()):
                return group
        return None

    @property
    def budget_kind(self) -> str:
        """The devices group budgets carve: the GPUs where there are any (a budget in MiB
        means VRAM on a GPU box), else RAM."""
        return "gpu" if any(d.kind == "gpu" for d in self.devices.values()) else "cpu"

    def pool_capacity(self, device: DeviceView, pool: str | None, ceiling: bool = True) -> int:
        """What a pool's models may hold on `device` in all. A group's budget is its own
        (capped by the device); the rest is what the device leaves after every group's
        budget. With `ceiling`, new loads stop at the low watermark, so placement does not
        fill what the watermark then evicts."""
        capacity = device.capacity
        if ceiling:
            capacity = min(capacity, max(0, self.line(device, self.low_watermark) - device.other))
        if not self.budgets or device.kind != self.budget_kind:
            return capacity
        if pool is not None:
            return min(self.budgets[pool], capacity)
        return max(0, capacity - sum(self.budgets.values()))

    def line(self, device: DeviceView, pct: float) -> int:
        """Bytes used at `pct` percent of `device`."""
        return int(device.total * pct / 100)
