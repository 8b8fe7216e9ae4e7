"""A GPU reader for tests (this machine has no NVIDIA GPU), shaped like NVML: each child of
the corral process it runs in holds `per_child_mb` on gpu0, and the device's used memory is
that plus `others_mb` (other processes). The test rewrites the JSON file
{"total_mb", "others_mb", "per_child_mb"} to make pressure come and go. Plugged in as
`memory.gpu_reader: plugin:<this file>:FileGpu` with `gpu_reader_options: {path: ...}`.

Several GPUs (`write_gpus`): fixed figures per GPU. With `child_mb` as well (`write_driver`),
it acts like the driver does: each child holds `child_mb` on the GPUs its own environment
lets it see (CUDA_VISIBLE_DEVICES, read from the real process; all of them without it),
shared out as its `--tensor-split` says (evenly without one), on top of the fixed figures."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from corral.supervisor.memory.devices import Device

MIB = 1024 * 1024


class FileGpu:
    def __init__(self, options: Mapping[str, Any]) -> None:
        self.path = Path(options["path"])
        self.options = options

    def _read(self) -> tuple[dict[str, float], list[int]]:
        data = json.loads(self.path.read_text())
        children = []
        for child in psutil.Process().children():
            try:
                # Exited but not yet reaped, or corral's group keeper (no GPU memory): not
                # a model's child.
                if child.status() != psutil.STATUS_ZOMBIE \
                        and "corral.supervisor.reaper" not in child.cmdline():
                    children.append(child.pid)
            except psutil.Error:
                continue
        return data, children

    def devices(self) -> list[Device]:
        # A driver that hangs: while the file `hang_while` exists, no answer.
        hang = self.options.get("hang_while")
        while hang and Path(hang).exists():
            time.sleep(0.05)
        data, children = self._read()
        if "gpus" in data:  # several GPUs, each {"total_mb", "used_mb"}
            held = self._held(data, children)
            out = []
            for name, g in sorted(data["gpus"].items()):
                ours = sum(h.get(name, 0) for h in held.values())
                used = min(g["total_mb"], g["used_mb"] + ours)
                out.append(Device(name, "gpu", int(g["total_mb"] * MIB), int(used * MIB),
                                  "injected by the test"))
            return out
        # Like NVML, never more than the device has.
        used = min(data["total_mb"], data["others_mb"] + data["per_child_mb"] * len(children))
        return [Device("gpu0", "gpu", int(data["total_mb"] * MIB), int(used * MIB),
                       "injected by the test")]

    @staticmethod
    def _held(data: dict[str, Any], children: list[int]) -> dict[int, dict[str, float]]:
        """pid → GPU → MiB, as a driver would see the children (driver mode only)."""
        if "child_mb" not in data:
            return {}
        names = sorted(data["gpus"])
        out: dict[int, dict[str, float]] = {}
        for pid in children:
            try:
                proc = psutil.Process(pid)
                visible = proc.environ().get("CUDA_VISIBLE_DEVICES")
                argv = proc.cmdline()
            except psutil.Error:
                continue
            gpus = [f"gpu{i.strip()}" for i in visible.split(",")] if visible else names
            gpus = [g for g in gpus if g in data["gpus"]]
            shares = [1.0] * len(gpus)
            if "--tensor-split" in argv:
                given = argv[argv.index("--tensor-split") + 1].split(",")
                if len(given) == len(gpus):
                    shares = [float(x) for x in given]
            total = sum(shares) or 1.0
            out[pid] = {g: data["child_mb"] * s / total for g, s in zip(gpus, shares, strict=True)}
        return out

    def usage_by_pid(self) -> Mapping[int, Mapping[str, int]]:
        data, children = self._read()
        if "gpus" in data:
            return {pid: {g: int(mb * MIB) for g, mb in held.items()}
                    for pid, held in self._held(data, children).items()}
        return {pid: {"gpu0": int(data["per_child_mb"] * MIB)} for pid in children}


def write(path: Path, total_mb: float, others_mb: float, per_child_mb: float = 700) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"total_mb": total_mb, "others_mb": others_mb,
                               "per_child_mb": per_child_mb}))
    tmp.replace(path)  # whole, never half-written


def write_gpus(path: Path, gpus: dict[str, tuple[float, float]]) -> None:
    """Several GPUs with fixed figures: name -> (total MiB, used MiB)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": {n: {"total_mb": t, "used_mb": u}
                                        for n, (t, u) in gpus.items()}}))
    tmp.replace(path)


def write_driver(path: Path, gpus: dict[str, tuple[float, float]], child_mb: float) -> None:
    """Several GPUs as a driver sees them: name -> (total MiB, MiB used by other processes);
    each child holds `child_mb` more on the GPUs it was given (see the module's docstring)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": {n: {"total_mb": t, "used_mb": u}
                                        for n, (t, u) in gpus.items()},
                               "child_mb": child_mb}))
    tmp.replace(path)
