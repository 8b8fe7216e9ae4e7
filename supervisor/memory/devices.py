"""Memory devices and what each child holds on them: NVIDIA GPUs through NVML (nvidia-ml-py),
AMD GPUs through amdsmi (memory/amd.py), RAM through psutil. Readers only read; deciding what
the numbers mean is the policy's job.

A device is named "cpu" (RAM) or "gpu<N>" (the reader's index). The GPU reader is an
interface: `auto` takes NVML where it finds GPUs, else amdsmi, else none; a test (or a box
with another vendor's GPUs) plugs in its own as `memory.gpu_reader: plugin:module:Class` or
`plugin:file.py:Class`. A reader may say which environment variable confines a child to some
of its GPUs (`visible_devices`; default CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import psutil
import structlog

from corral.supervisor.plugins import PluginError, load_object

log = structlog.get_logger("corral.memory")

__all__ = ["CUDA_VISIBLE", "AutoGpus", "Device", "GpuReader", "NoGpus", "NvmlReader",
           "RamReader", "load_gpu_reader", "visible_devices_of"]

CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Device:
    name: str  # "cpu", "gpu0", ...
    kind: Literal["cpu", "gpu"]
    total: int  # bytes
    used: int  # bytes, by everyone (corral's children included)
    label: str = ""

    @property
    def free(self) -> int:
        return max(0, self.total - self.used)

    @property
    def used_pct(self) -> float:
        return 100.0 * self.used / self.total if self.total else 0.0


@runtime_checkable
class GpuReader(Protocol):
    """What corral reads of the GPUs. Both calls are made from a worker thread, every
    `memory.interval` seconds and before a load decision; each must return within
    milliseconds."""

    def devices(self) -> list[Device]:
        """Every GPU: total and used memory."""
        ...

    def usage_by_pid(self) -> Mapping[int, Mapping[str, int]]:
        """pid → device name → bytes that process holds (compute processes)."""
        ...


class NoGpus:
    """A machine without GPUs (or `gpu_reader: none`)."""

    def devices(self) -> list[Device]:
        return []

    def usage_by_pid(self) -> Mapping[int, Mapping[str, int]]:
        return {}


def visible_devices_of(reader: GpuReader) -> str:
    """The variable that confines a child to some of `reader`'s GPUs."""
    found = getattr(reader, "visible_devices", CUDA_VISIBLE)
    return found if isinstance(found, str) and found else CUDA_VISIBLE


class NvmlReader:
    """NVIDIA GPUs through NVML. Without a driver (no libnvidia-ml) it reads no GPUs and says
    so once in the log; it never raises into the daemon. NVML numbers GPUs in PCI bus order;
    a child placed on some gets CUDA_VISIBLE_DEVICES with CUDA_DEVICE_ORDER=PCI_BUS_ID, so
    CUDA numbers them the same way (its default, fastest first, may not)."""

    visible_devices = CUDA_VISIBLE

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self._lock = threading.Lock()  # NVML calls come from worker threads
        self._handles: list[Any] | None = None
        self._nvml: Any = None

    def _init(self) -> list[Any]:
        if self._handles is not None:
            return self._handles
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
            log.info("memory.nvml", gpus=count)
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self._handles = []
            log.info("memory.no_nvml", reason=f"{type(exc).__name__}: {exc}",
                     note="GPU memory is not measured; RAM is")
        return self._handles

    def devices(self) -> list[Device]:
        with self._lock:
            out = []
            for i, handle in enumerate(self._init()):
                try:
                    info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                    name = self._nvml.nvmlDeviceGetName(handle)
                except Exception as exc:
                    log.warning("memory.nvml_read_failed", gpu=i, error=str(exc))
                    continue
                label = name.decode() if isinstance(name, bytes) else str(name)
                out.append(Device(f"gpu{i}", "gpu", int(info.total), int(info.used), label))
            return out

    def usage_by_pid(self) -> Mapping[int, Mapping[str, int]]:
        with self._lock:
            usage: dict[int, dict[str, int]] = {}
            for i, handle in enumerate(self._init()):
                try:
                    procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                except Exception:
                    continue
                for p in procs:
                    used = p.usedGpuMemory
                    if used is None:  # NVML_VALUE_NOT_AVAILABLE (some vGPU/MIG setups)
                        continue
                    usage.setdefault(int(p.pid), {})[f"gpu{i}"] = int(used)
            return usage


class RamReader:
    """RAM through psutil: the machine's total and available memory, and each child's
    resident memory with its process tree (a child's helpers count against it)."""

    def device(self) -> Device:
        vm = psutil.virtual_memory()
        # "used" = what cannot be handed out now: total minus available (which counts
        # reclaimable cache as free, as the kernel does).
        return Device("cpu", "cpu", int(vm.total), int(vm.total - vm.available), "RAM")

    def usage_detail(self, pids: Iterable[int]) -> dict[int, tuple[int, int]]:
        """pid → (resident, private) bytes with its process tree. Private leaves out
        file-backed and shared pages (mmap'd weights): the kernel counts those as available,
        so they are not in the RAM's "used"."""
        out = {}
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                rss = private = 0
                for p in (proc, *proc.children(recursive=True)):
                    with contextlib.suppress(psutil.Error):
                        info = p.memory_info()
                        rss += info.rss
                        private += max(0, info.rss - getattr(info, "shared", 0))
                out[pid] = (int(rss), int(private))
        return out

    def usage(self, pids: Iterable[int]) -> dict[int, int]:
        out = {}
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                total = proc.memory_info().rss
                for child in proc.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        total += child.memory_info().rss
                out[pid] = int(total)
        return out


class AutoGpus:
    """`gpu_reader: auto`: NVML where it finds GPUs, else amdsmi, else none; chosen at the
    first read (from the sampler's thread) and kept."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self._lock = threading.Lock()
        self._chosen: GpuReader | None = None

    def _reader(self) -> GpuReader:
        with self._lock:
            if self._chosen is None:
                from corral.supervisor.memory.amd import AmdSmiReader

                chosen: GpuReader = NoGpus()
                for candidate in (NvmlReader(), AmdSmiReader()):
                    if candidate.devices():
                        chosen = candidate
                        break
                self._chosen = chosen
            return self._chosen

    @property
    def visible_devices(self) -> str:
        # Read on the event loop: never the first read of the devices (that blocks).
        return visible_devices_of(self._chosen) if self._chosen is not None else CUDA_VISIBLE

    def devices(self) -> list[Device]:
        return self._reader().devices()

    def usage_by_pid(self) -> Mapping[int, Mapping[str, int]]:
        return self._reader().usage_by_pid()


def load_gpu_reader(spec: str, options: Mapping[str, Any], base_dir: Path) -> GpuReader:
    """`auto` (default), `nvml`, `amdsmi`, `none`, or a plugin class built with `options`."""
    if spec == "auto":
        return AutoGpus(options)
    if spec == "nvml":
        return NvmlReader(options)
    if spec == "amdsmi":
        from corral.supervisor.memory.amd import AmdSmiReader

        return AmdSmiReader(options)
    if spec == "none":
        return NoGpus()
    if not spec.startswith("plugin:"):
        raise PluginError(f"unknown gpu_reader {spec!r}; expected auto, nvml, amdsmi, none, "
                          f"plugin:package.module:Class or plugin:file.py:Class")
    cls = load_object(spec, base_dir)
    try:
        reader = cls(options)
    except Exception as exc:
        raise PluginError(f"{spec}: building the reader failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    missing = [m for m in ("devices", "usage_by_pid") if not callable(getattr(reader, m, None))]
    if missing:
        raise PluginError(f"{spec} is not a GPU reader: it lacks {', '.join(missing)}")
    return reader  # type: ignore[no-any-return]
