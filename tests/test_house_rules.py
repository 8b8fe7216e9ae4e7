"""The house rules DESIGN.md states that a test can hold: arrows point one way (proxy/ reaches
the supervisor through supervisor/port.py only), config is data, no module over 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_FOR_PROXY = ("corral.supervisor.daemon", "corral.supervisor.instance",
                       "corral.supervisor.reservation")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_proxy_reaches_the_supervisor_only_through_its_port() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name for name in _imports(path)
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN_FOR_PROXY))
        for path in (ROOT / "proxy").rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_loading_a_config_imports_no_plugin_loader() -> None:
    """Config is data: the strategy and GPU reader are built by supervisor/runtime.py."""
    loaders = {"corral.supervisor.policy.load_strategy",
               "corral.supervisor.memory.devices.load_gpu_reader",
               "corral.supervisor.plugins.load_object"}
    offenders = {str(p.relative_to(ROOT)): sorted(_imports(p) & loaders)
                 for p in (ROOT / "supervisor" / "config").rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_no_module_has_two_jobs_by_size() -> None:
    """One job per module; none over 600 lines (past that, it has two jobs: split it)."""
    long = {str(p.relative_to(ROOT)): n for folder in ("supervisor", "proxy")
            for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
