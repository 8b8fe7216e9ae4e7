"""What a GPU reader says is checked before any decision uses it: a reader (NVML through a
driver bug, amdsmi, a plugin) that gives an impossible figure for one child must not become
what that model is counted at from then on. In-process, on the tracker (no daemon, no GPU)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import structlog

from corral.supervisor.config import parse_config
from corral.supervisor.config.schema.memory import MemoryConfig
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.memory.devices import Device
from corral.supervisor.memory.tracker import MemoryTracker

MIB = 1024 * 1024


class Reader:
    """One 8000 MiB GPU, 1000 MiB used; this process (standing in for a child) holds `held`."""

    def __init__(self) -> None:
        self.held: object = 100 * MIB

    def devices(self) -> list[Device]:
        return [Device("gpu0", "gpu", 8000 * MIB, 1000 * MIB, "test")]

    def usage_by_pid(self) -> Mapping[int, Mapping[str, object]]:
        return {os.getpid(): {"gpu0": self.held}}


class Child:
    name = "m"
    served = 1  # answered a request: its peak is what its settings are learned at

    def __init__(self, spec: ModelSpec) -> None:
        self.started_with = spec

    @property
    def pid(self) -> int:
        return os.getpid()


def _tracker(model: Path) -> tuple[MemoryTracker, Reader, Child, ModelSpec]:
    reader = Reader()
    tracker = MemoryTracker(MemoryConfig(reserve_mb=0), reader)
    tracker.take(tracker.read([]), [])
    spec = tracker.with_cache_ram(parse_config(f"models:\n  m:\n    model: {model}\n")
                                  .models["m"], (None, None))
    child = Child(spec)
    tracker.started(child)
    return tracker, reader, child, spec


def _sample(tracker: MemoryTracker, child: Child) -> None:
    tracker.take(tracker.read([child.pid]), [child])


def test_a_per_process_figure_larger_than_its_gpu_is_left_out(
        tiny_models: dict[str, Path]) -> None:
    tracker, reader, child, spec = _tracker(tiny_models["tiny-a"])
    before = tracker.need(spec, (None, None))["gpu0"]
    with structlog.testing.capture_logs() as logs:
        reader.held = 10**15  # one bad answer: a petabyte on an 8000 MiB GPU
        _sample(tracker, child)
        reader.held = 100 * MIB
        _sample(tracker, child)
    # Neither the running child nor the next start of its settings is counted at it.
    assert tracker.footprint(child)["gpu0"] < 8000 * MIB
    assert tracker.need(spec, (None, None))["gpu0"] == before
    assert [e for e in logs if e["event"] == "memory.gpu_reader_failed"
            and "more than its" in e["error"]], logs


def test_a_negative_or_unreadable_per_process_figure_is_left_out(
        tiny_models: dict[str, Path]) -> None:
    tracker, reader, child, spec = _tracker(tiny_models["tiny-a"])
    for bad in (-5 * MIB, float("nan"), None):
        reader.held = bad
        _sample(tracker, child)  # no exception reaches the caller
        assert tracker.sample is not None and "gpu0" not in tracker.sample.by_pid[child.pid]
        assert tracker.footprint(child)["gpu0"] > 0  # counted at its estimate meanwhile
