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


def _package_imports(package: Path) -> dict[str, set[str]]:
    """Each module of `package` → the modules of the same package it imports (TYPE_CHECKING
    imports and imports inside functions included: a circle is a circle)."""
    prefix = "corral." + ".".join(package.relative_to(ROOT).parts)
    modules = {f"{prefix}.{p.stem}" if p.stem != "__init__" else prefix: p
               for p in package.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        for imported in _imports(path):
            for candidate in modules:
                if candidate != name and candidate != prefix and (
                        imported == candidate or imported.startswith(candidate + ".")):
                    graph[name].add(candidate)
    return graph


def test_no_import_circle_inside_the_daemon_the_model_or_the_instance() -> None:
    """DESIGN: no import circle inside a package; a part that needs the whole daemon gets the
    few things it uses."""
    circles = []
    for folder in ("daemon", "instance", "model"):
        graph = _package_imports(ROOT / "supervisor" / folder)

        def reaches(start: str, goal: str, seen: set[str], graph: dict[str, set[str]] = graph,
                    ) -> bool:
            for nxt in graph[start]:
                if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                    return True
            return False

        circles += [f"{a} ⇄ {b}" for a in graph for b in graph[a] if reaches(b, a, {b})]
    assert not circles, circles


def test_the_daemon_is_made_of_objects_not_of_functions_bound_from_other_modules() -> None:
    """No `acquire = door_part.acquire`: every function on Daemon is defined in its class."""
    import inspect

    from corral.supervisor.daemon import Daemon

    foreign = sorted(name for name, value in vars(Daemon).items()
                     if inspect.isfunction(value) and value.__module__ != Daemon.__module__)
    assert not foreign, foreign
    from corral.supervisor.instance import Instance

    foreign = sorted(name for name, value in vars(Instance).items()
                     if inspect.isfunction(value) and value.__module__ != Instance.__module__)
    assert not foreign, foreign
