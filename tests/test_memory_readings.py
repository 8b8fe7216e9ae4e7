"""What a GPU reader says is checked before any decision uses it: a reader (NVML through a
driver bug, amdsmi, a plugin) that gives an impossible figure for one child must not become
what that model is counted at from then on. In-process, on the tracker (no daemon, no GPU)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from fake_gpu import write as write_gpu

from corral.supervisor.config import parse_config
from corral.supervisor.config.schema.memory import MemoryConfig
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.memory.devices import Device
from corral.supervisor.memory.tracker import MemoryTracker

from conftest import CorralFactory, tiny_config, wait_until

MIB = 1024 * 1024


class Reader:
    """One 8000 MiB GPU, 1000 MiB used; this process (standing in for a child) holds `held`."""

    def __init__(self) -> None:
        self.held: Any = 100 * MIB

    def devices(self) -> list[Device]:
        return [Device("gpu0", "gpu", 8000 * MIB, 1000 * MIB, "test")]

    def usage_by_pid(self) -> Mapping[int, Mapping[str, Any]]:
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
    tracker, reader, child, _spec = _tracker(tiny_models["tiny-a"])
    for bad in (-5 * MIB, float("nan"), None):
        reader.held = bad
        _sample(tracker, child)  # no exception reaches the caller
        assert tracker.sample is not None and "gpu0" not in tracker.sample.by_pid[child.pid]
        assert tracker.footprint(child)["gpu0"] > 0  # counted at its estimate meanwhile


class Failing(Reader):
    """Two GPUs of different sizes; `broken`: devices() raises; `nonsense`: gpu1's used is
    over its total (a driver bug, a plugin's mistake)."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = self.nonsense = False

    def devices(self) -> list[Device]:
        if self.broken:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        used1 = 90000 if self.nonsense else 20000
        return [Device("gpu0", "gpu", 8000 * MIB, 7000 * MIB, "small"),
                Device("gpu1", "gpu", 24000 * MIB, used1 * MIB, "big")]


def test_a_reader_that_fails_leaves_each_gpu_at_its_last_good_figures(
        tiny_models: dict[str, Path]) -> None:
    reader = Failing()
    tracker = MemoryTracker(MemoryConfig(reserve_mb=0), reader)
    spec = parse_config(f"models:\n  m:\n    model: {tiny_models['tiny-a']}\n").models["m"]
    tracker.take(tracker.read([]), [])
    good = tracker.need(spec, (None, None))
    assert good.get("gpu0", 0) > 0 or good.get("gpu1", 0) > 0
    with structlog.testing.capture_logs() as logs:
        reader.broken = True
        tracker.take(tracker.read([]), [])
        sample = tracker.sample
        assert sample is not None and sample.stale == {"gpu0", "gpu1"}
        # Still on the GPUs, at the figures last read: not estimated on the CPU, and a
        # placement still sees how full they are.
        assert tracker.need(spec, (None, None)) == good
        view = tracker.view([], 0)
        assert view is not None and view.devices["gpu0"].used == 7000 * MIB
        # One GPU with nonsense: that one stays at its last figures, the other is read.
        reader.broken, reader.nonsense = False, True
        tracker.take(tracker.read([]), [])
        assert tracker.sample is not None and tracker.sample.stale == {"gpu1"}
        assert tracker.sample.devices["gpu1"].used == 20000 * MIB
        reader.nonsense = False
        tracker.take(tracker.read([]), [])
        assert tracker.sample is not None and not tracker.sample.stale
    events = [e["event"] for e in logs]
    assert events.count("memory.gpu_reader_failed") == 2, logs
    assert events[-1] == "memory.gpu_reader_recovered", logs


FAKE_GPU = Path(__file__).with_name("fake_gpu.py")


@pytest.mark.expect_log("memory.gpu_reader_failed", "proxy.request_failed")
def test_a_load_is_not_let_onto_a_full_gpu_while_its_reader_fails(
        start_corral: CorralFactory, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A GPU past the critical watermark refuses new loads; a reader that then fails (NVML
    after an Xid, a plugin's bad file) must not make the GPU vanish and let the load on."""
    gpu = tmp_path / "gpu.json"
    write_gpu(gpu, total_mb=10000, others_mb=9700)
    corral = start_corral(tiny_config(
        tiny_models, ["tiny-a"],
        memory={"interval": 0.2, "gpu_reader": f"plugin:{FAKE_GPU}:FileGpu",
                "gpu_reader_options": {"path": str(gpu)}}))

    def gpu0() -> dict[str, Any] | None:
        devices = corral.http.get("/admin/memory").json()["devices"]
        return next((d for d in devices if d["name"] == "gpu0"), None)
    wait_until(lambda: (found := gpu0()) is not None and found["pressure"] == "critical",
               timeout=10)
    gpu.write_text("{not json")  # the reader raises from now on
    wait_until(lambda: corral.log_events("memory.gpu_reader_failed"), timeout=10)
    response = corral.chat("tiny-a", max_tokens=2)
    assert response.status_code == 503, response.text
    assert "critical watermark" in response.json()["error"]["message"]
    assert corral.spawned("tiny-a") == []


@pytest.mark.expect_log("memory.gpu_reader_failed")
def test_a_driver_that_never_answers_holds_neither_ram_readings_nor_the_exit(
        start_corral: CorralFactory, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The GPU read waits in a thread of its own, with its own deadline: RAM is sampled
    while it hangs, and corral stops on SIGTERM with the read still hung (the teardown
    checks the exit)."""
    gpu, hang = tmp_path / "gpu.json", tmp_path / "hang"
    write_gpu(gpu, total_mb=10000, others_mb=1000)
    hang.touch()  # and it stays: the driver never answers
    corral = start_corral(tiny_config(
        tiny_models, ["tiny-a"],
        memory={"interval": 0.2, "gpu_reader": f"plugin:{FAKE_GPU}:FileGpu",
                "gpu_reader_options": {"path": str(gpu), "hang_while": str(hang)}}))
    wait_until(lambda: corral.log_events("memory.gpu_reader_failed"), timeout=30)
    memory = corral.http.get("/admin/memory").json()
    assert [d["name"] for d in memory["devices"]] == ["cpu"]
    assert memory["sampled_ago"] is not None and memory["sampled_ago"] < 10
