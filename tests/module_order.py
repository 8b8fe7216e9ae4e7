"""How test modules go to xdist's workers (`make test` runs `-n N --dist loadfile`), and what
each took.

A module is one work unit (its module-scoped daemons and children are shared by its tests);
a worker takes the next unit in file order when it finishes one. Handed out longest first
(tried: by each module's measured seconds), the heaviest modules (SmolLM2 prefills, vLLM,
the swap bench) ran all at once at the start on a 2-core box that the suite keeps 97 % busy
either way: 16:46 with three tests past their deadlines, against 15:21 and none in file
order, where they meet lighter ones. xdist's own reorder (most tests first) is off for the
same reason: the file order is the one measured.

Two exceptions, the longest modules that are not SmolLM2 prefills: test_vllm.py and
test_docs_examples.py go first. test_vllm's children take two minutes of one worker whatever
runs beside them, and last in file order they were the suite's tail (a worker busy alone for
the run's last ~2 minutes: 10:52 in all, where the modules' seconds over 3 workers came to
9:25; 10:02 with test_vllm first, 9:58 with both).

Each run writes each module's seconds (setup, calls and teardown of its tests) to
build/module-seconds.json, to see where the suite's time goes.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

MEASURED = Path(__file__).resolve().parent.parent / "build" / "module-seconds.json"


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# Modules handed out before all others (the rest keep file order).
FIRST = ("tests/test_vllm.py", "tests/test_docs_examples.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # In every process, whatever the options: xdist's workers run with `dist` "no" and hand
    # the controller their collection, whose order the controller keeps. A stable sort, the
    # same in every worker, as xdist requires.
    items.sort(key=lambda item: _module(item.nodeid) not in FIRST)


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") != "loadfile":
        return
    config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Recorder(), "module-seconds-recorder")


class _Recorder:
    """On xdist's controller: each module's seconds."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[_module(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        if not self.seconds:
            return
        MEASURED.parent.mkdir(exist_ok=True)
        MEASURED.write_text(json.dumps(
            {m: round(s, 1) for m, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])},
            indent=1) + "\n")
