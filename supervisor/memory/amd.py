"""AMD GPUs through AMD's own `amdsmi` Python binding (ROCm's amd-smi, installed with ROCm:
/opt/rocm/share/amd_smi; it is not a usable PyPI package, so it is an optional import).

The calls and return shapes are those of ROCm/amdsmi's py-interface/amdsmi_interface.py
(ROCm 6.x): amdsmi_init(AmdSmiInitFlags.INIT_AMD_GPUS); amdsmi_get_processor_handles() → a
list of handles; amdsmi_get_gpu_memory_total / amdsmi_get_gpu_memory_usage(handle,
AmdSmiMemoryType.VRAM) → bytes; amdsmi_get_gpu_asic_info(handle)["market_name"];
amdsmi_get_gpu_process_list(handle) → [{"pid", "mem", "memory_usage": {"gtt_mem", "cpu_mem",
"vram_mem"}, ...}] (ROCm 5.7's returned process handles, each read with
amdsmi_get_gpu_process_info(handle, process) into the same dict). Checked against a stand-in
of these calls only (tests/test_multi_gpu.py): no AMD GPU was at hand.

A child placed on some of these GPUs gets HIP_VISIBLE_DEVICES (read by the HIP runtime, so by
llama.cpp's HIP build, PyTorch-ROCm and vLLM). Not ROCR_VISIBLE_DEVICES as well: the two
compose (HIP numbers what ROCR leaves), so setting both to the same index would hide it.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from typing import Any

import structlog

from corral.supervisor.memory.devices import Device

log = structlog.get_logger("corral.memory")

__all__ = ["HIP_VISIBLE", "AmdSmiReader"]

HIP_VISIBLE = "HIP_VISIBLE_DEVICES"


class AmdSmiReader:
    """AMD GPUs through amdsmi. Without the binding or a driver it reads no GPUs and says so
    once in the log; it never raises into the daemon."""

    visible_devices = HIP_VISIBLE

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self._lock = threading.Lock()  # called from worker threads
        self._handles: list[Any] | None = None
        self._smi: Any = None

    def _init(self) -> list[Any]:
        if self._handles is not None:
            return self._handles
        try:
            smi = importlib.import_module("amdsmi")
            smi.amdsmi_init(smi.AmdSmiInitFlags.INIT_AMD_GPUS)
            self._handles = list(smi.amdsmi_get_processor_handles())
            self._smi = smi
            log.info("memory.amdsmi", gpus=len(self._handles))
        except Exception as exc:  # ImportError, AmdSmiLibraryException (no driver), ...
            self._handles = []
            log.info("memory.no_amdsmi", reason=f"{type(exc).__name__}: {exc}",
                     note="AMD GPU memory is not measured")
        return self._handles

    def devices(self) -> list[Device]:
        with self._lock:
            out = []
            for i, handle in enumerate(self._init()):
                smi = self._smi
                try:
                    vram = smi.AmdSmiMemoryType.VRAM
                    total = int(smi.amdsmi_get_gpu_memory_total(handle, vram))
                    used = int(smi.amdsmi_get_gpu_memory_usage(handle, vram))
                except Exception as exc:
                    log.warning("memory.amdsmi_read_failed", gpu=i, error=str(exc))
                    continue
                out.append(Device(f"gpu{i}", "gpu", total, used, self._label(handle)))
            return out

    def _label(self, handle: Any) -> str:
        try:
            name = self._smi.amdsmi_get_gpu_asic_info(handle).get("market_name")
        except Exception:  # a label is no reason to leave a GPU out
            return "AMD GPU"
        return str(name) if name and name != "N/A" else "AMD GPU"

    def usage_by_pid(self) -> Mapping[int, Mapping[str, int]]:
        with self._lock:
            usage: dict[int, dict[str, int]] = {}
            for i, handle in enumerate(self._init()):
                try:
                    procs = list(self._smi.amdsmi_get_gpu_process_list(handle))
                except Exception:
                    continue
                for proc in procs:
                    info = proc if isinstance(proc, dict) else self._process_info(handle, proc)
                    vram = (info or {}).get("memory_usage", {}).get("vram_mem")
                    # "N/A" where the driver does not say (no per-process figure).
                    if info is None or not isinstance(vram, int):
                        continue
                    usage.setdefault(int(info["pid"]), {})[f"gpu{i}"] = vram
            return usage

    def _process_info(self, handle: Any, process: Any) -> dict[str, Any] | None:
        try:
            found = self._smi.amdsmi_get_gpu_process_info(handle, process)
        except Exception:
            return None
        return found if isinstance(found, dict) else None
