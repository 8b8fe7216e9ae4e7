"""A file of live child pids, so children of a daemon killed with SIGKILL are reaped at the next
start even where the parent-death signal could not fire (e.g. a child that re-parented itself)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import structlog

log = structlog.get_logger("corral.statefile")


@dataclass(frozen=True)
class ChildRecord:
    model: str
    pid: int
    create_time: float  # guards against pid reuse: only this exact process is ours


def default_state_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "corral"
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "corral"


class ChildRegistry:
    def __init__(self, path: Path):
        self.path = path

    def record(self, children: list[tuple[str, int]]) -> None:
        records = []
        for model, pid in children:
            try:
                records.append(ChildRecord(model, pid, psutil.Process(pid).create_time()))
            except psutil.NoSuchProcess:
                continue
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps([asdict(r) for r in records]))
        tmp.replace(self.path)

    def reap_leftovers(self) -> list[int]:
        """Kill the process groups of children a previous daemon left behind."""
        try:
            records = [ChildRecord(**r) for r in json.loads(self.path.read_text())]
        except FileNotFoundError:
            return []
        except (ValueError, TypeError) as exc:
            log.warning("statefile.unreadable", path=str(self.path), error=str(exc))
            return []
        reaped = []
        for rec in records:
            try:
                proc = psutil.Process(rec.pid)
                if abs(proc.create_time() - rec.create_time) > 0.01:
                    continue
            except psutil.NoSuchProcess:
                continue
            # Children lead their own process group (start_new_session): group id == pid.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rec.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(rec.pid, signal.SIGKILL)
            reaped.append(rec.pid)
            log.warning("statefile.reaped_orphan", model=rec.model, pid=rec.pid)
        self.clear()
        return reaped

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
