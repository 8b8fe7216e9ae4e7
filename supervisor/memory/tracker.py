"""The daemon's memory bookkeeping: samples devices and children, keeps each model's estimate
beside what it really took, learns from it, and builds the policy's `MemoryView`.

Reading is done from a worker thread every `memory.interval` (psutil walks /proc, NVML talks
to the driver); decisions in between use the latest sample, corrected for children that
stopped since (their memory is no longer counted) and children starting (counted at their
estimate until measured)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from corral.supervisor.backends import backend_for
from corral.supervisor.config.schema.memory import MemoryConfig
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.memory import cache_ram
from corral.supervisor.memory.devices import Device, GpuReader, RamReader
from corral.supervisor.memory.estimate import Estimate
from corral.supervisor.memory.llama_reports import parse_load_log
from corral.supervisor.memory.view import MIB, DeviceView, Footprint, MemoryView

log = structlog.get_logger("corral.memory")

__all__ = ["Child", "MemoryTracker", "Sample", "start_key"]

KvTypes = tuple[str | None, str | None]


class Child(Protocol):
    """What the tracker reads of an instance."""

    name: str
    started_with: ModelSpec
    served: int  # requests its current child has answered

    @property
    def pid(self) -> int | None: ...


@dataclass(frozen=True)
class Sample:
    at: float  # monotonic
    devices: Mapping[str, Device]
    by_pid: Mapping[int, Mapping[str, int]]  # our children only: what each holds per device
    # RAM a child holds that is its own (resident less file-backed and shared pages): the
    # kernel counts mmap'd weights as available, so only this part is in the RAM "used".
    private: Mapping[int, int] = field(default_factory=dict)
    # GPUs whose reading failed this time, carried over at their last good figures.
    stale: frozenset[str] = frozenset()


@dataclass
class Record:
    """One child's memory: what was estimated before it started, what it took."""

    estimate: Estimate | None
    pid: int | None = None
    peak: dict[str, int] = field(default_factory=dict)
    log_breakdown: dict[str, dict[str, int]] = field(default_factory=dict)
    log_read: bool = False
    served: bool = False  # answered a request: its weights are paged in, its peak is real


# Set by placement at a start: the GPUs in the key say the same.
_PLACEMENT_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                            "ROCR_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"})
# Estimates kept (each start key once); split shares vary with free memory, so bounded.
_ESTIMATES_KEPT = 512
# How long a sample waits for the GPU reader (under the memory loop's own deadline): a driver
# that hangs leaves its GPUs at their last figures while RAM and the children go on being read.
GPU_READ_TIMEOUT_S = 5.0

GpuReading = tuple[dict[str, Device], set[str], dict[int, dict[str, int]]]


class _GpuRead:
    """One read of the GPU reader in a thread of its own; a daemon thread, so a driver that
    never answers holds neither a sample nor corral's exit."""

    def __init__(self, read: Any) -> None:
        self.done = threading.Event()
        self.result: GpuReading | None = None
        threading.Thread(target=self._run, args=(read,), daemon=True,
                         name="corral-gpu-read").start()

    def _run(self, read: Any) -> None:
        try:
            self.result = read()
        finally:
            self.done.set()


def start_key(spec: ModelSpec, kv: KvTypes, gpus: tuple[str, ...]) -> tuple[Any, ...]:
    """What decides a child's memory: the same key takes the same memory every time."""
    try:
        stat = spec.model_path.stat()
        version: tuple[int, int] = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        version = (0, 0)
    env = tuple(sorted((k, v) for k, v in spec.env.items() if k not in _PLACEMENT_ENV))
    return (str(spec.model_path), version, spec.backend, spec.binary, spec.ctx, spec.parallel,
            spec.n_gpu_layers, kv[0] or "f16", kv[1] or "f16", gpus, spec.gpu_split,
            spec.args, str(spec.mmproj), env, spec.model_id, spec.command,
            spec.tensor_parallel_size, spec.pipeline_parallel_size, spec.cache_ram_mb)


class MemoryTracker:
    def __init__(self, config: MemoryConfig, gpu_reader: GpuReader) -> None:
        self.config = config
        self.gpu_reader = gpu_reader
        self.ram = RamReader()
        self.sample: Sample | None = None
        # Per child (instance), not per name: a blue/green switch runs two under one name.
        self.records: weakref.WeakKeyDictionary[Any, Record] = weakref.WeakKeyDictionary()
        self._learned: dict[tuple[Any, ...], dict[str, int]] = {}  # start key → what it took
        self._estimates: dict[tuple[Any, ...], Estimate | None] = {}
        self._estimate_errors: dict[str, str] = {}  # model path → why (logged once)
        self._ladders: dict[tuple[Any, ...], tuple[tuple[str, str], ...]] = {}
        self._calm_since: float | None = time.monotonic()
        self._reader_problem: str | None = None
        self._read_failed = False  # this read had a problem (reading thread only)
        # Each GPU's last good reading: a reader that fails (or answers nonsense) leaves the
        # GPU where it was last seen, not gone; gone, a load would be placed without a look
        # at it (estimated on the CPU, started on every GPU).
        self._last_gpus: dict[str, Device] = {}
        self._gpu_read: _GpuRead | None = None  # the one read of the GPUs under way
        self.kv_changes: dict[str, dict[str, int]] = {}  # model → {"down": n, "up": n}

    # -- reading (worker thread) ---------------------------------------------------------------

    def read(self, pids: Iterable[int]) -> Sample:
        """Read every device and `pids`' usage. Blocking: call it from a thread. What a GPU
        reader returns is checked: a plugin's bad figure is logged and left out, never let
        into decisions (a GPU it cannot read stays at its last good figures, `stale`)."""
        pids = list(pids)
        self._read_failed = False
        devices, stale, gpu_use = self._read_gpus()
        devices["cpu"] = self.ram.device()  # after the GPUs: a GPU named "cpu" is not RAM
        by_pid: dict[int, dict[str, int]] = {pid: {} for pid in pids}
        for pid in pids:
            for device, used in gpu_use.get(pid, {}).items():
                found = devices.get(device)
                if found is None:
                    continue
                if used > found.total:
                    # Impossible: kept, it would become the child's peak, then what every
                    # later start of its settings is counted at (refused as never fitting).
                    self._reader_failed(f"usage_by_pid(): pid {pid} holds {used} bytes on "
                                        f"{device}, more than its {found.total}")
                    continue
                by_pid[pid][device] = used
        private: dict[int, int] = {}
        for pid, (rss, own) in self.ram.usage_detail(pids).items():
            by_pid[pid]["cpu"] = rss
            private[pid] = own
        if not self._read_failed and self._reader_problem is not None:
            log.info("memory.gpu_reader_recovered", reader=self.config.gpu_reader,
                     was=self._reader_problem)
            self._reader_problem = None
        return Sample(time.monotonic(), devices, by_pid, private, frozenset(stale))

    def _read_gpus(self) -> GpuReading:
        """The GPUs and what each process holds there, within GPU_READ_TIMEOUT_S; else the
        GPUs at their last figures (all stale). One read at a time: a hung one is waited on
        again at the next sample, never joined by a second thread."""
        if self._gpu_read is None:
            self._gpu_read = _GpuRead(lambda: (*self._gpu_devices(), self._gpu_usage()))
        pending = self._gpu_read
        if not pending.done.wait(GPU_READ_TIMEOUT_S):
            self._reader_failed(f"no answer within {GPU_READ_TIMEOUT_S:g}s (a driver that "
                                "hangs)")
            return dict(self._last_gpus), set(self._last_gpus), {}
        self._gpu_read = None
        if pending.result is None:  # raised past its own checks
            return dict(self._last_gpus), set(self._last_gpus), {}
        return pending.result

    def _gpu_devices(self) -> tuple[dict[str, Device], set[str]]:
        """Each GPU as read now, or as last read where this read failed for it (named in
        the second value)."""
        try:
            found = list(self.gpu_reader.devices())
        except Exception as exc:
            self._reader_failed(f"devices(): {type(exc).__name__}: {exc}")
            return dict(self._last_gpus), set(self._last_gpus)
        fresh: dict[str, Device] = {}
        bad: list[str] = []
        for d in found:
            try:
                device = Device(str(d.name), "gpu", int(d.total), int(d.used), str(d.label))
            except Exception:  # None, NaN, not a Device at all
                bad.append(str(getattr(d, "name", d)))
                continue
            if device.total <= 0 or not 0 <= device.used <= device.total:
                bad.append(device.name)
                continue
            fresh[device.name] = device
        if bad:
            self._reader_failed(f"devices(): impossible figures for {', '.join(bad)}")
        stale = {n for n in bad if n in self._last_gpus and n not in fresh}
        self._last_gpus = {n: d for n, d in self._last_gpus.items() if n in stale} | fresh
        return dict(self._last_gpus), stale

    def _gpu_usage(self) -> dict[int, dict[str, int]]:
        try:
            found = {int(pid): {str(d): int(n) for d, n in usage.items()}
                     for pid, usage in self.gpu_reader.usage_by_pid().items()}
        except Exception as exc:
            self._reader_failed(f"usage_by_pid(): {type(exc).__name__}: {exc}")
            return {}
        bad = sorted({pid for pid, usage in found.items() if any(n < 0 for n in usage.values())})
        if bad:
            self._reader_failed(f"usage_by_pid(): negative figures for pid {bad[0]}")
        return {pid: usage for pid, usage in found.items() if pid not in bad}

    def _reader_failed(self, problem: str) -> None:
        self._read_failed = True
        if problem != self._reader_problem:  # once per kind of failure
            self._reader_problem = problem
            log.error("memory.gpu_reader_failed", reader=self.config.gpu_reader, error=problem,
                      note="a GPU it cannot read counts at its last good figures, and "
                           "nothing is evicted for memory pressure, until it answers again")

    # -- bookkeeping (event loop) --------------------------------------------------------------

    def take(self, sample: Sample, children: Iterable[Child]) -> None:
        """Adopt a sample: each live child's measurement, the pressure clock."""
        self.sample = sample
        for child in children:
            record = self.records.get(child)
            pid = child.pid
            if record is None or pid is None or pid not in sample.by_pid:
                continue
            if record.pid != pid:  # measured for the first time
                record.pid, record.peak = pid, {}
            for device, used in sample.by_pid[pid].items():
                record.peak[device] = max(record.peak.get(device, 0), used)
            record.served = child.served > 0
            if record.served:
                spec = child.started_with
                key = start_key(spec, _kv_of(spec), self.gpus_of(spec))
                self._learned[key] = dict(self._charge(record))
        if self._pressured(sample):
            self._calm_since = None
        elif self._calm_since is None:
            self._calm_since = sample.at

    def _pressured(self, sample: Sample) -> bool:
        # With GPUs, their pressure is what KV steps answer; RAM pressure evicts CPU models.
        gpus = [d for d in sample.devices.values() if d.kind == "gpu"]
        return any(d.used_pct >= self.config.low_watermark
                   for d in (gpus or sample.devices.values()))

    @property
    def gpus(self) -> tuple[str, ...]:
        if self.sample is None:
            return ()
        return tuple(sorted(n for n, d in self.sample.devices.items() if d.kind == "gpu"))

    def gpus_of(self, spec: ModelSpec) -> tuple[str, ...]:
        """The GPUs a start of `spec` uses: where placement put it, else all of them."""
        return spec.placed_gpus if spec.placed_gpus is not None else self.gpus

    def device_free(self) -> dict[str, int]:
        """Free bytes of each device ("cpu", "gpu0"...), as last read."""
        if self.sample is None:
            return {}
        return {n: d.free for n, d in self.sample.devices.items()}

    def gpu_totals(self) -> dict[str, int]:
        """Each GPU's size in bytes, as last read."""
        if self.sample is None:
            return {}
        return {n: d.total for n, d in self.sample.devices.items() if d.kind == "gpu"}

    def ram_budget(self) -> int:
        """What corral's children may take of RAM in all: the machine's RAM less the
        reserve, capped by budget_mb (not less what others use now: a child's settings must
        not move with the machine's load)."""
        total = self.sample.devices["cpu"].total if self.sample and "cpu" in \
            self.sample.devices else self.ram.device().total
        room = max(0, total - int(self.config.reserve_mb * MIB))
        return min(room, int(self.config.budget_mb * MIB)) if self.config.budget_mb else room

    def with_cache_ram(self, spec: ModelSpec, kv: KvTypes) -> ModelSpec:
        """`spec` with its auto `cache_ram_mb` made a number: a share of the RAM budget,
        0 where RAM is tight for this model (memory/cache_ram.py). As it is otherwise."""
        if spec.backend != "llama-server" or spec.cache_ram_mb is not None \
                or cache_ram.own_mib(spec.args, spec.env) is not None:
            return spec
        bare = dataclasses.replace(spec, cache_ram_mb=0)
        found = self.estimate_for(bare, kv)
        if found is None:  # nothing known of the model: its cache stays off, as counted
            return bare
        return dataclasses.replace(spec, cache_ram_mb=cache_ram.auto_mib(
            self.ram_budget(), found.devices.get("cpu", 0), found.kv))

    def estimate_for(self, spec: ModelSpec, kv: KvTypes) -> Estimate | None:
        """The backend's estimate from the model's files for these settings (None: they
        cannot be read; logged once)."""
        spec = self.with_cache_ram(spec, kv)
        gpus = self.gpus_of(spec)
        key = start_key(spec, kv, gpus)
        if key not in self._estimates:
            while len(self._estimates) >= _ESTIMATES_KEPT:  # the oldest first
                del self._estimates[next(iter(self._estimates))]
            try:
                self._estimates[key] = backend_for(spec.backend).estimate(spec, kv, gpus)
            except Exception as exc:  # a file we cannot read is no reason to fail a request
                self._note_estimate_error(spec, exc)
                self._estimates[key] = None
        return self._estimates[key]

    def _note_estimate_error(self, spec: ModelSpec, exc: Exception) -> None:
        where = spec.model_id or str(spec.model_path)
        if self._estimate_errors.get(where) != str(exc):
            self._estimate_errors[where] = str(exc)
            log.warning("memory.no_estimate", model=spec.name, error=str(exc),
                        note="this model's memory is not counted until it is measured")

    def ladder(self, spec: ModelSpec) -> tuple[tuple[str, str], ...]:
        """The model's KV ladder less the steps its backend says it cannot run (a child that
        would fail to start)."""
        key = (spec.backend, str(spec.model_path), spec.kv_ladder)
        if key not in self._ladders:
            try:
                usable = backend_for(spec.backend).usable_kv_steps(spec)
            except Exception as exc:
                self._note_estimate_error(spec, exc)
                self._ladders[key] = spec.kv_ladder
                return spec.kv_ladder
            if len(usable) < len(spec.kv_ladder):
                log.warning("memory.kv_steps_skipped", model=spec.name,
                            skipped=["/".join(s) for s in spec.kv_ladder if s not in usable],
                            note="quantized KV types need head sizes divisible by 32")
            self._ladders[key] = usable or spec.kv_ladder[:1]
        return self._ladders[key]

    def warm(self, spec: ModelSpec) -> None:
        """Read the model's headers now (from a thread), so decisions find them cached."""
        with contextlib.suppress(Exception):
            self.estimate_for(spec, (spec.cache_type_k, spec.cache_type_v))

    def need(self, spec: ModelSpec, kv: KvTypes) -> Footprint:
        """What a start with these settings takes: what the same settings took before, else
        the estimate. Empty when neither is known (it is then not counted)."""
        spec = self.with_cache_ram(spec, kv)
        learned = self._learned.get(start_key(spec, kv, self.gpus_of(spec)))
        if learned is not None:
            return learned
        found = self.estimate_for(spec, kv)
        return found.devices if found is not None else {}

    def started(self, child: Child) -> None:
        """A child is starting: it counts at its estimate until measured."""
        spec = child.started_with
        self.records[child] = Record(self.estimate_for(spec, _kv_of(spec)))

    def read_log(self, child: Child, lines: Iterable[str]) -> None:
        """llama-server's own account of its buffers, once it is ready (read once: without
        `-lv 4` it does not print them)."""
        record = self.records.get(child)
        if record is not None and not record.log_read:
            record.log_read = True
            with contextlib.suppress(Exception):  # a log format we do not know is no error
                record.log_breakdown = parse_load_log(lines)

    def _charge(self, record: Record) -> dict[str, int]:
        """What a measured child counts as, per device: the larger of its peak and the
        estimate (a short or cancelled first request pages in only part of the weights)."""
        est = dict(record.estimate.devices) if record.estimate else {}
        for device, peak in record.peak.items():
            est[device] = max(peak, est.get(device, 0))
        return est

    def footprint(self, child: Child) -> Footprint:
        """What a live child holds now, per device: its measured peak, the estimate as a floor
        and for what nothing measured."""
        record = self.records.get(child)
        if record is None:
            return {}
        if record.pid != child.pid:  # not measured yet
            return dict(record.estimate.devices) if record.estimate else {}
        return self._charge(record)

    # -- the policy's view ---------------------------------------------------------------------

    def view(self, live: Iterable[Child], now: float) -> MemoryView | None:
        sample = self.sample
        if sample is None:
            return None
        live_pids = {c.pid for c in live if c.pid is not None}
        gone: dict[str, int] = {}
        ours: dict[str, int] = {}
        for pid, usage in sample.by_pid.items():
            target = ours if pid in live_pids else gone
            for device, used in usage.items():
                if device == "cpu":
                    used = sample.private.get(pid, used)
                target[device] = target.get(device, 0) + used
        # A child the sample saw on a device without a per-process figure (a reader without
        # one, MIG, a container's pid namespace) is in the device's "used" all the same:
        # count it as ours at its estimate, not as another process's memory.
        for child, record in list(self.records.items()):
            if child.pid in live_pids and child.pid in sample.by_pid and record.estimate:
                measured = sample.by_pid[child.pid]
                for device, n in record.estimate.devices.items():
                    if device not in measured and device in sample.devices:
                        ours[device] = ours.get(device, 0) + n
        cfg = self.config
        budget = int(cfg.budget_mb * MIB) if cfg.budget_mb is not None else None
        devices = {name: DeviceView(
            name=name, kind=d.kind, total=d.total,
            # A child that stopped since the sample no longer holds what it held then.
            used=max(0, d.used - gone.get(name, 0)), ours=min(ours.get(name, 0), d.used),
            reserve=int(cfg.reserve_mb * MIB), budget=budget)
            for name, d in sample.devices.items()}
        calm = 0.0 if self._calm_since is None else max(0.0, now - self._calm_since)
        return MemoryView(devices=devices, low_watermark=cfg.low_watermark,
                          critical_watermark=cfg.critical_watermark,
                          budgets={g: int(mb * MIB) for g, mb in cfg.budgets.items()},
                          calm_for=calm, gpu_placement=cfg.gpu_placement)

    def count_kv_change(self, model: str, direction: str) -> None:
        counts = self.kv_changes.setdefault(model, {"down": 0, "up": 0})
        counts[direction] += 1
        # The hold counts from the last change: the next step up waits for a sample that
        # shows what this one did.
        if self._calm_since is not None:
            self._calm_since = time.monotonic()

    def describe(self, child: Child) -> dict[str, Any]:
        """/admin/memory's entry for one child: estimate, measured, error."""
        record = self.records.get(child)
        if record is None:
            return {"estimate_mib": None, "measured_mib": None, "error_pct": None,
                    "served": False, "llama_log_mib": None}
        est = record.estimate
        measured = record.peak if record.pid is not None and record.pid == child.pid else {}
        # Compared on the devices measured (a GPU without per-process figures is not).
        # Less the RAM prompt cache: counted at its limit, it fills only with use.
        est_on = sum(est.devices.get(d, 0) for d in measured) if est else 0
        if est and "cpu" in measured:
            est_on -= est.cache_ram
        measured_total = sum(measured.values())
        error = (round(100.0 * (est_on - measured_total) / measured_total, 1)
                 if est_on and measured_total else None)
        return {
            "estimate_mib": mib_map(est.devices) if est else None,
            "estimate_source": est.source if est else None,
            "estimate_breakdown_mib": {k: round(v / MIB, 1) for k, v in (
                ("weights", est.weights), ("kv", est.kv), ("compute", est.compute),
                ("overhead", est.overhead), ("cache_ram", est.cache_ram))} if est else None,
            "measured_mib": mib_map(measured) if measured else None,
            "error_pct": error,
            "llama_log_mib": {d: {k: round(v / MIB, 2) for k, v in parts.items()}
                              for d, parts in record.log_breakdown.items()} or None,
            "served": record.served,
        }

    def reconfigure(self, config: MemoryConfig, gpu_reader: GpuReader | None) -> None:
        self.config = config
        if gpu_reader is not None:
            self.gpu_reader = gpu_reader
            self._estimates.clear()
            self._reader_problem = None
            self._last_gpus = {}  # another reader's GPUs are not these
            self._gpu_read = None


def _kv_of(spec: ModelSpec) -> KvTypes:
    return (spec.cache_type_k, spec.cache_type_v)


def mib_map(values: Mapping[str, int]) -> dict[str, float]:
    return {d: round(v / MIB, 1) for d, v in sorted(values.items())}


