"""The order test modules go to xdist's workers (`make test` runs `-n N --dist loadfile`).

A module is one work unit (its module-scoped daemons and children are shared by its tests),
and a worker takes the next unit when it finishes one: the run ends when the last unit does.
Handed out in file order, a 2-minute module collected last ran alone at the end; handed out
longest first, the short ones fill the gaps. How long each module takes comes from
module_seconds.json (a module not in it counts as long: it is new, and likely starts
children). Each run under xdist writes what it measured to build/module-seconds.json:
copy that over module_seconds.json when modules have changed a lot.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

HERE = Path(__file__).parent
KNOWN = HERE / "module_seconds.json"
MEASURED = HERE.parent / "build" / "module-seconds.json"
UNKNOWN_SECONDS = 60.0


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") != "loadfile":
        return
    # Under loadfile xdist would sort modules by their number of tests: the order made
    # below is the one wanted.
    config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Recorder(), "module-seconds-recorder")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return  # only an xdist worker's collection decides what the workers are handed
    try:
        known = {str(k): float(v) for k, v in json.loads(KNOWN.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        known = {}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(_module(item.nodeid), i)
    # Stable: within a module, and among modules of equal weight, the file order stays.
    items.sort(key=lambda item: (-known.get(_module(item.nodeid), UNKNOWN_SECONDS),
                                 first_seen[_module(item.nodeid)]))


class _Recorder:
    """On xdist's controller: each module's seconds (setup, call and teardown of its tests)."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[_module(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        if not self.seconds:
            return
        try:
            merged = json.loads(MEASURED.read_text())
            if not isinstance(merged, dict):
                merged = {}
        except (OSError, ValueError):
            merged = {}
        merged.update({m: round(s, 1) for m, s in self.seconds.items()})
        MEASURED.parent.mkdir(exist_ok=True)
        MEASURED.write_text(json.dumps(dict(sorted(merged.items(), key=lambda kv: -kv[1])),
                                       indent=1) + "\n")
